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

from depthfusion_hf.models import depthfusion_common, dwa, dwa_triton  # noqa: E402
from depthfusion_hf.models.dwa import depth_weighted_average  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_is_available_and_auto_dispatch():
    assert depthfusion_common.triton_available()
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


def test_matches_torch_backend_bf16_sources():
    """bf16 sources with fp32 weights under bf16 autocast (a bf16 Trainer's DenseFormer): both efficient paths read
    bf16, accumulate in fp32 and return the promoted dtype, fp32 (autocast does not lower the sum); the sources'
    gradients are rounded once to bf16.

    On a GPU the rounding is to nearest-even in both; the interpreter's fp32 -> bf16 cast truncates,
    so the bf16 gradients agree to one bf16 ulp (rel-RMS ~ 2^-8), fp32 results to fp32 precision.
    """
    sources, weights = make_inputs(7, (2, 3, 37), torch.bfloat16, DEVICE, weight_dtype=torch.float32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y_tr = depth_weighted_average(sources, weights, backend="triton")
        y_pt = depth_weighted_average(sources, weights, backend="torch")
    assert y_tr.dtype == y_pt.dtype == torch.float32
    assert rel_rms(y_tr, y_pt) <= 1e-6
    tol = 1e-3 if DEVICE == "cuda" else 8e-3
    g = torch.randn_like(y_tr)
    dw_tr, *dxs_tr = torch.autograd.grad(y_tr, [weights, *sources], g)
    dw_pt, *dxs_pt = torch.autograd.grad(y_pt, [weights, *sources], g)
    assert rel_rms(dw_tr, dw_pt) <= 1e-5
    for a, b in zip(dxs_tr, dxs_pt):
        assert a.dtype == torch.bfloat16
        assert rel_rms(a, b) <= tol


def test_bf16_weights():
    sources, _ = make_inputs(2, (9,), torch.float32, DEVICE)
    weights = torch.tensor([0.5, -1.25], device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y = depth_weighted_average(sources, weights, backend="triton")
    torch.testing.assert_close(y, 0.5 * sources[0].detach() - 1.25 * sources[1].detach())
    (dw,) = torch.autograd.grad(y, [weights], torch.ones_like(y))
    assert dw.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mixed_dtype_sources_under_autocast(dtype):
    """Under autocast an fp32 embedding is followed by half-precision block outputs: each source is read in its own
    dtype (the old kernel read every pointer as the first source's dtype, and the op rejected the mix), the output
    has the promoted dtype (fp32: autocast does not lower the residual stream's sum), each gradient its source's
    dtype; the same numbers as the reference backend."""
    sources, weights = make_inputs(4, (5, 40), dtype, DEVICE, weight_dtype=torch.float32)
    sources[0] = sources[0].detach().float().mul(3).requires_grad_(True)  # fp32, values not representable in dtype
    grad_out = torch.randn(5, 40, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    results = {}
    for backend in ("triton", "reference"):
        with torch.autocast(DEVICE, dtype=dtype):
            y = depth_weighted_average(sources, weights, backend=backend)
        results[backend] = (y, *torch.autograd.grad(y, [weights, *sources], grad_out))
    y_ref64 = sum(w.double() * x.double() for w, x in zip(weights.detach(), sources))
    for backend, (y, dw, *dxs) in results.items():
        assert y.dtype == torch.float32 and dw.dtype == torch.float32, backend
        assert [dx.dtype for dx in dxs] == [torch.float32] + [dtype] * 3, backend
        assert rel_rms(y, y_ref64) <= 1e-6, backend  # fp32 sums of exactly converted inputs
    tri, ref = results["triton"], results["reference"]
    # The interpreter's fp32 -> half casts truncate (one ulp); fp32 results agree to fp32 summation order.
    assert rel_rms(tri[0], ref[0]) <= 1e-6
    assert rel_rms(tri[1], ref[1]) <= 1e-6
    assert rel_rms(tri[2], ref[2]) <= 1e-6  # the fp32 source's gradient: w * g stored in fp32
    for a, b in zip(tri[3:], ref[3:]):
        assert rel_rms(a, b) <= torch.finfo(dtype).eps


@pytest.mark.parametrize("n", [16, 17, 33, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_more_sources_than_one_launch_takes(n, dtype):
    """More than ``SOURCES_PER_LAUNCH`` sources: chained launches carry an fp32 partial sum (a 1x1 DenseFormer of
    48 blocks reads 49 sources); values and every gradient match the reference."""
    sources, weights = make_inputs(n, (3, 37), dtype, DEVICE)
    y = depth_weighted_average(sources, weights, backend="triton")
    grad_out = torch.randn(3, 37, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    grads = torch.autograd.grad(y, [weights, *sources], grad_out)
    assert_matches_reference(y, grads, sources, weights, grad_out)


def test_launches_take_the_sources_as_arguments(monkeypatch):
    """No table of data pointers is built on the host per call (a pageable int64 tensor copied every call cannot be
    captured in a CUDA graph, breaks dynamo, and gives scalar loads): the sources themselves are the kernels'
    pointer arguments, at most SOURCES_PER_LAUNCH per launch; every other argument is a tensor on the sources'
    device (never int64) or a Python scalar."""
    launches = []
    for kernel in (dwa_triton.dwa_fwd_kernel, dwa_triton.dwa_bwd_kernel):

        def run(*args, _original=kernel.run, _name=kernel.fn.__name__, **kwargs):
            launches.append((_name, args))
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    sources, weights = make_inputs(20, (4, 33), torch.bfloat16, DEVICE)
    created = []
    tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: created.append(a) or tensor(*a, **k))
    y = depth_weighted_average(sources, weights, backend="triton")
    torch.autograd.grad(y, [weights, *sources], torch.ones_like(y))
    assert created == []
    assert [name for name, _ in launches] == ["dwa_fwd_kernel"] * 2 + ["dwa_bwd_kernel"] * 2
    for kind in ("dwa_fwd_kernel", "dwa_bwd_kernel"):
        passed = {a.data_ptr() for name, args in launches if name == kind for a in args[:16]}
        assert passed == {x.data_ptr() for x in sources}, kind
    for name, args in launches:
        assert all(isinstance(a, (torch.Tensor, int, bool)) for a in args), name
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        assert all(t.device == sources[0].device and t.dtype != torch.int64 for t in tensors), name


def test_float64_is_routed_to_pytorch_by_the_dispatcher():
    """The kernel rejects float64; the op (and the model's core) computes it on the PyTorch path."""
    sources, weights = make_inputs(3, (4, 9), torch.float64, DEVICE)
    with pytest.raises(ValueError, match="Triton DWA supports"):
        dwa_triton.triton_depth_weighted_average(sources, weights, torch.float64)
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

if dwa_triton.triton is not None:
    tl = dwa_triton.tl

    @dwa_triton.triton.jit
    def _offsets_probe(p_out, pid, BLOCK: tl.constexpr):
        tl.store(p_out + tl.arange(0, BLOCK), dwa_triton.block_offsets(pid, BLOCK))

    @dwa_triton.triton.jit
    def _int32_offsets_probe(p_out, pid, BLOCK: tl.constexpr):
        tl.store(p_out + tl.arange(0, BLOCK), pid * BLOCK + tl.arange(0, BLOCK))


def test_block_offsets_are_64_bit_past_2_to_the_31():
    """A program's flat offsets past 2^31 (a [B, T, D] state of more than 2^31 elements) are exact; the same
    product in int32 wraps (checked too, so that the probe can tell the two apart)."""
    pid, block = 2**25 + 7, 64
    expected = torch.arange(block, dtype=torch.int64) + pid * block
    assert int(expected[0]) > 2**31
    out = torch.zeros(block, dtype=torch.int64, device=DEVICE)
    _offsets_probe[(1,)](out, pid, BLOCK=block)
    assert torch.equal(out.cpu(), expected)
    wrapped = torch.zeros(block, dtype=torch.int64, device=DEVICE)
    _int32_offsets_probe[(1,)](wrapped, pid, BLOCK=block)
    assert not torch.equal(wrapped.cpu(), expected)

