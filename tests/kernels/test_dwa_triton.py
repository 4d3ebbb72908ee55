"""The fused Triton DWA against the float64 reference: values and gradients, fp32/bf16/fp16.

Runs in-process on CUDA, or on CPU when ``TRITON_INTERPRET=1`` was set before the kernels were
imported; a plain CPU ``pytest`` run executes this module in an interpreted child process
(``test_dwa_interpreted.py``) and skips it here.
"""

from __future__ import annotations

import pytest
import torch

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
from tests.kernels.interpret import kernels_run_in_process

if not kernels_run_in_process():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (run through test_dwa_interpreted.py)", allow_module_level=True)

from depthfusion_hf.models.denseformer import dwa, dwa_triton  # noqa: E402
from depthfusion_hf.models.denseformer.dwa import depth_weighted_average  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_is_available_and_auto_dispatch():
    assert dwa_triton.dwa_triton_forward_backward_available()
    assert dwa.triton_depth_weighted_average is dwa_triton.triton_depth_weighted_average
    expected = "triton" if DEVICE == "cuda" else "torch"  # auto uses Triton for CUDA tensors only
    assert dwa.resolve_backend(None, torch.device(DEVICE)) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "shape"), SHAPES, ids=[f"N{n}-S{'x'.join(map(str, s))}" for n, s in SHAPES])
def test_forward_backward_matches_reference(n, shape, dtype):
    sources, weights = make_inputs(n, shape, dtype, DEVICE)
    y = depth_weighted_average(sources, weights, backend="triton")
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    grads = torch.autograd.grad(y, [weights, *sources], grad_out)
    assert_matches_reference(y, grads, sources, weights, grad_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_non_contiguous_sources(dtype):
    sources, weights = make_inputs(3, (4, 6, 19), dtype, DEVICE, non_contiguous=True)
    assert not any(x.is_contiguous() for x in sources)
    y = depth_weighted_average(sources, weights, backend="triton")
    grad_out = torch.randn(19, 6, 4).to(DEVICE, dtype).transpose(0, 2)  # non-contiguous gradient too
    grads = torch.autograd.grad(y, [weights, *sources], grad_out)
    assert_matches_reference(y, grads, sources, weights, grad_out)


def test_stacked_states_tensor_and_views_with_offsets():
    """A [N, *S] tensor is unbound into views at non-zero offsets: the pointer array must honour them."""
    states = torch.randn(5, 3, 41, device=DEVICE, requires_grad=True)
    weights = torch.randn(5, device=DEVICE, requires_grad=True)
    y = depth_weighted_average(states, weights, backend="triton")
    grad_out = torch.randn_like(y)
    d_states, dw = torch.autograd.grad(y, [states, weights], grad_out)
    y_ref = torch.einsum("n,nij->ij", weights.double(), states.double())
    assert rel_rms(y, y_ref) <= 1e-6
    assert rel_rms(d_states, weights.double()[:, None, None] * grad_out.double()) <= 1e-6
    assert rel_rms(dw, torch.einsum("nij,ij->n", states.double(), grad_out.double())) <= 1e-6


def test_many_blocks_and_masked_tail(monkeypatch):
    """Small blocks: several programs, a partial last block, and the per-block dw partial sums."""
    if DEVICE == "cpu":
        monkeypatch.setattr(dwa_triton, "INTERPRET_MAX_BLOCK", 64)
    numel = 3 * 5 * 37 if DEVICE == "cpu" else 5 * 1024 + 17  # 9 blocks of 64 (last one partial) / 6 of 1024
    sources, weights = make_inputs(4, (numel,), torch.float32, DEVICE)
    y = depth_weighted_average(sources, weights, backend="triton")
    grad_out = torch.randn(numel, device=DEVICE)
    grads = torch.autograd.grad(y, [weights, *sources], grad_out)
    assert_matches_reference(y, grads, sources, weights, grad_out)


def test_partial_requires_grad():
    """Only some inputs need gradients: the others get None and the rest stay exact."""
    sources, weights = make_inputs(3, (7, 11), torch.float32, DEVICE)
    sources[1] = sources[1].detach()
    y = depth_weighted_average(sources, weights, backend="triton")
    g = torch.randn_like(y)
    y.backward(g)
    assert sources[1].grad is None
    for n in (0, 2):
        torch.testing.assert_close(sources[n].grad, weights[n].detach() * g)
    torch.testing.assert_close(weights.grad, torch.stack([(g * x.detach()).sum() for x in sources]))

    # weights frozen: only the source gradients are produced.
    sources, weights = make_inputs(2, (5, 3), torch.float32, DEVICE)
    weights = weights.detach()
    y = depth_weighted_average(sources, weights, backend="triton")
    dxs = torch.autograd.grad(y, sources, torch.ones_like(y))
    for n, dx in enumerate(dxs):
        torch.testing.assert_close(dx, weights[n].expand(5, 3).contiguous())

    # sources frozen: only the weight gradient.
    sources, weights = make_inputs(2, (5, 3), torch.float32, DEVICE)
    sources = [x.detach() for x in sources]
    y = depth_weighted_average(sources, weights, backend="triton")
    (dw,) = torch.autograd.grad(y, [weights], torch.ones_like(y))
    torch.testing.assert_close(dw, torch.stack([x.sum() for x in sources]))


def test_matches_torch_backend_bf16():
    """Both efficient paths accumulate in fp32 and round once to bf16.

    On a GPU the rounding is to nearest-even in both; the interpreter's fp32 -> bf16 cast truncates,
    so values agree to one bf16 ulp (rel-RMS ~ 2^-8) and the fp32 weight gradients to fp32 precision.
    """
    sources, weights = make_inputs(7, (2, 3, 37), torch.bfloat16, DEVICE)
    y_tr = depth_weighted_average(sources, weights, backend="triton")
    y_pt = depth_weighted_average(sources, weights, backend="torch")
    tol = 1e-3 if DEVICE == "cuda" else 8e-3
    assert 0 < rel_rms(y_tr, y_pt) <= tol or torch.equal(y_tr, y_pt)
    g = torch.randn_like(y_tr)
    dw_tr, *dxs_tr = torch.autograd.grad(y_tr, [weights, *sources], g)
    dw_pt, *dxs_pt = torch.autograd.grad(y_pt, [weights, *sources], g)
    assert rel_rms(dw_tr, dw_pt) <= 1e-5
    for a, b in zip(dxs_tr, dxs_pt):
        assert rel_rms(a, b) <= tol


def test_bf16_weights():
    sources, _ = make_inputs(2, (9,), torch.float32, DEVICE)
    weights = torch.tensor([0.5, -1.25], device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y = depth_weighted_average(sources, weights, backend="triton")
    torch.testing.assert_close(y, 0.5 * sources[0].detach() - 1.25 * sources[1].detach())
    (dw,) = torch.autograd.grad(y, [weights], torch.ones_like(y))
    assert dw.dtype == torch.bfloat16


def test_float64_is_routed_to_pytorch_by_the_dispatcher():
    """The kernel rejects float64; the op (and the model's core) computes it on the PyTorch path."""
    sources, weights = make_inputs(3, (4, 9), torch.float64, DEVICE)
    with pytest.raises(ValueError, match="Triton DWA supports"):
        dwa_triton.triton_depth_weighted_average(sources, weights)
    y = depth_weighted_average(sources, weights, backend="triton")
    grad_out = torch.randn(4, 9, dtype=torch.float64, device=DEVICE)
    grads = torch.autograd.grad(y, [weights, *sources], grad_out)
    assert_matches_reference(y, grads, sources, weights, grad_out)
    assert torch.autograd.gradgradcheck(lambda w, *xs: depth_weighted_average(list(xs), w, backend="triton"),
                                        (weights, *sources))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_second_order_gradients(dtype):
    """create_graph=True: the kernel's backward records nothing, so it is rebuilt from PyTorch ops."""
    assert_second_order_matches_reference(lambda s, w: depth_weighted_average(s, w, backend="triton"), dtype,
                                          DEVICE, TOL[dtype])


@pytest.mark.parametrize(("depth", "dilation", "period"), CHAINS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dense_chain_matches_torch_backend(depth, dilation, period, dtype):
    """A simulated k×p DenseFormer on the kernel: the same loss and gradients as on the PyTorch path."""
    x0, scales, alphas = chain_inputs(depth, dilation, period, dtype, DEVICE)
    losses, grads = {}, {}
    for backend in ("triton", "torch"):
        losses[backend] = dense_chain_loss(depth, dilation, period, x0, scales, alphas,
                                           lambda s, ids, w, b=backend: depth_weighted_average(s, w, backend=b))
        grads[backend] = torch.autograd.grad(losses[backend], [x0, scales, alphas])
    # Both accumulate in fp32 and round once per step; they differ in summation order (fp32) and, in
    # bf16, by the interpreter's truncating casts (one bf16 ulp, 2 u, per rounding on ~2 d roundings).
    u = torch.finfo(dtype).eps / 2
    tol = 2 * depth * 2.0**-23 if dtype == torch.float32 else 2 * u * (2 * depth) ** 0.5
    assert abs(losses["triton"].item() - losses["torch"].item()) <= tol * abs(losses["torch"].item())
    for a, b in zip(grads["triton"], grads["torch"]):
        assert rel_rms(a, b) <= tol
