"""The PyTorch DWA path (``backend="torch"``) and the paper's loop against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from depthfusion_hf.models import dwa
from depthfusion_hf.models.dwa import depth_weighted_average, dwa_torch
from tests.kernels._dwa_cases import (
    CHAINS,
    SHAPES,
    TOL,
    assert_matches_reference,
    assert_second_order_matches_reference,
    chain_inputs,
    dense_chain_loss,
    make_inputs,
    rel_rms,
)


@pytest.fixture(autouse=True, params=["list", "stacked"])
def torch_path(request, monkeypatch):
    """Run every test through both PyTorch paths: the list Function (large states) and the stacked
    matrix-vector product (states of at most ``SMALL_NUMEL`` elements, e.g. cached decoding)."""
    monkeypatch.setattr(dwa, "SMALL_NUMEL", -1 if request.param == "list" else 1 << 40)
    return request.param


@pytest.mark.parametrize(("backend", "dtype"), [("torch", torch.float32), ("torch", torch.bfloat16),
                                                ("reference", torch.float32), ("reference", torch.bfloat16)],
                         ids=["torch-fp32", "torch-bf16", "reference-fp32", "reference-bf16"])
@pytest.mark.parametrize(("n", "shape"), SHAPES, ids=[f"N{n}-S{'x'.join(map(str, s))}" for n, s in SHAPES])
def test_forward_backward_matches_reference(n, shape, dtype, backend):
    sources, weights = make_inputs(n, shape, dtype, "cpu")
    y = depth_weighted_average(sources, weights, backend=backend)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(y, [weights, *sources], grad_out)
    assert_matches_reference(y, grads, sources, weights, grad_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_non_contiguous_sources(dtype):
    sources, weights = make_inputs(3, (4, 6, 19), dtype, "cpu", non_contiguous=True)
    assert not any(x.is_contiguous() for x in sources)
    y = depth_weighted_average(sources, weights, backend="torch")
    grad_out = torch.randn(19, 6, 4).to(dtype).transpose(0, 2)
    grads = torch.autograd.grad(y, [weights, *sources], grad_out)
    assert_matches_reference(y, grads, sources, weights, grad_out)


def test_half_precision_gradient_is_rounded_once():
    """Under autocast with fp32 weights (a bf16 ``Trainer``): ``dx = w * g`` is computed with the fp32 weight and
    rounded once to bf16 (no double rounding); the output has the promoted dtype, fp32 (autocast does not lower
    the residual stream's sum), accumulated in fp32."""
    sources, weights = make_inputs(3, (4096,), torch.bfloat16, "cpu", weight_dtype=torch.float32)
    g = torch.randn(4096).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = depth_weighted_average(sources, weights, backend="torch")
    assert y.dtype == torch.float32
    _, *dxs = torch.autograd.grad(y, [weights, *sources], g)
    u = 2.0**-8  # bf16 unit roundoff
    for n, dx in enumerate(dxs):
        exact = g.double() * weights.detach().double()[n]
        # Rounded once: within half a bf16 ulp (u relative) of the exact product, plus the fp32 product's
        # own rounding (2^-24). Rounding the weight to bf16 first (twice-rounded) misses this by up to u.
        assert bool(((dx.double() - exact).abs() <= (u + 2.0**-24) * exact.abs()).all())
    expected_y = sum(x.detach().float() * w for x, w in zip(sources, weights.detach()))
    assert rel_rms(y, expected_y) <= 1e-6  # fp32 accumulation


def test_gradcheck_float64():
    sources, weights = make_inputs(4, (3, 5), torch.float64, "cpu")
    assert torch.autograd.gradcheck(lambda w, *xs: dwa_torch(list(xs), w, torch.float64), (weights, *sources))
    assert torch.autograd.gradgradcheck(lambda w, *xs: dwa_torch(list(xs), w, torch.float64), (weights, *sources))


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_second_order_gradients(backend, dtype):
    """create_graph=True through the backward (gradient penalties): the definition's second derivatives."""
    assert_second_order_matches_reference(lambda s, w: depth_weighted_average(s, w, backend=backend), dtype, "cpu",
                                          TOL[dtype])


def test_gradcheck_float64_stacked_and_non_contiguous():
    states = torch.randn(3, 5, 4, dtype=torch.float64).transpose(1, 2).requires_grad_(True)
    weights = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, w: depth_weighted_average(s, w, backend="torch"), (states, weights))


def test_stacked_tensor_equals_list():
    states = torch.randn(6, 2, 33)
    weights = torch.randn(6)
    torch.testing.assert_close(depth_weighted_average(states, weights, backend="torch"),
                               depth_weighted_average(list(states), weights, backend="reference"))


def test_does_not_modify_inputs_and_saves_no_copies(torch_path):
    """The output is a fresh tensor; the inputs are unchanged; the list path's graph holds only the inputs."""
    sources, weights = make_inputs(3, (8, 8), torch.float32, "cpu")
    before = [x.detach().clone() for x in sources]
    y = depth_weighted_average(sources, weights, backend="torch")
    assert all(y.data_ptr() != x.data_ptr() for x in sources)
    if torch_path == "list":
        saved = y.grad_fn.saved_tensors
        assert {t.data_ptr() for t in saved} == {x.data_ptr() for x in sources} | {weights.data_ptr()}
    y.sum().backward()
    for x, b in zip(sources, before):
        assert torch.equal(x.detach(), b)


def test_single_source_is_a_scaling():
    x = torch.randn(5, 7, requires_grad=True)
    w = torch.tensor([2.5], requires_grad=True)
    y = depth_weighted_average([x], w, backend="torch")
    torch.testing.assert_close(y, 2.5 * x.detach())
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.5))
    torch.testing.assert_close(w.grad, x.detach().sum().reshape(1))


def test_no_grad_inference_matches(torch_path):
    sources, weights = make_inputs(5, (2, 1, 96), torch.float32, "cpu")
    with torch.no_grad():
        y = depth_weighted_average(sources, weights, backend="torch")
    assert not y.requires_grad
    torch.testing.assert_close(y, sum(w * x.detach() for w, x in zip(weights.detach(), sources)))


def test_mixed_source_dtypes_promote_without_autocast(torch_path):
    """An fp32 source among bf16 ones (and fp32 weights): the output is fp32, each gradient in its source's dtype."""
    sources, weights = make_inputs(3, (5, 40), torch.bfloat16, "cpu", weight_dtype=torch.float32)
    sources[0] = sources[0].detach().float().requires_grad_(True)
    y = depth_weighted_average(sources, weights, backend="torch")
    assert y.dtype == torch.float32
    grad_out = torch.randn(5, 40)
    grads = torch.autograd.grad(y, [weights, *sources], grad_out)
    y_ref = sum(w.double() * x.double() for w, x in zip(weights.detach(), sources))
    assert rel_rms(y, y_ref) <= 1e-6
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]


def test_small_threshold_selects_the_path(monkeypatch):
    monkeypatch.setattr(dwa, "SMALL_NUMEL", 10)
    small = depth_weighted_average([torch.randn(10, requires_grad=True)] * 2, torch.ones(2), backend="torch")
    large = depth_weighted_average([torch.randn(11, requires_grad=True)] * 2, torch.ones(2), backend="torch")
    assert type(large.grad_fn).__name__ == "_DepthWeightedAverageBackward"
    assert type(small.grad_fn).__name__ != "_DepthWeightedAverageBackward"


# --- Through depth: a simulated k×p DenseFormer, every source read by several steps -----------------


@pytest.mark.parametrize(("depth", "dilation", "period"), CHAINS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_dense_chain_matches_reference_backend(depth, dilation, period, dtype):
    """Gradients summed over all the steps that read a block output equal the paper's loop's."""
    x0, scales, alphas = chain_inputs(depth, dilation, period, dtype, "cpu")
    ours = dense_chain_loss(depth, dilation, period, x0, scales, alphas,
                            lambda s, ids, w: depth_weighted_average(s, w, backend="torch"))
    grads = torch.autograd.grad(ours, [x0, scales, alphas])
    leaves = [t.detach().double().requires_grad_(True) for t in (x0, scales, alphas)]
    ref = dense_chain_loss(depth, dilation, period, *leaves,
                           lambda s, ids, w: depth_weighted_average(s, w, backend="reference"))
    grads_ref = torch.autograd.grad(ref, leaves)
    # ~2 d roundings along the chain (block, DWA step), each <= u = eps / 2 relative: d eps, doubled for
    # the backward's second pass over the chain (measured <= 0.24 d eps in fp32 and fp64).
    tol = 2 * depth * torch.finfo(dtype).eps
    assert abs(ours.item() - ref.item()) <= tol * abs(ref.item())
    for a, b in zip(grads, grads_ref):
        assert rel_rms(a, b) <= tol


def test_dense_chain_gradgradcheck_float64():
    x0, scales, alphas = chain_inputs(5, 2, 1, torch.float64, "cpu", shape=(2, 3))

    def f(x0, scales, alphas):
        return dense_chain_loss(5, 2, 1, x0, scales, alphas,
                                lambda s, ids, w: depth_weighted_average(s, w, backend="torch"))

    assert torch.autograd.gradcheck(f, (x0, scales, alphas))
    assert torch.autograd.gradgradcheck(f, (x0, scales, alphas))
