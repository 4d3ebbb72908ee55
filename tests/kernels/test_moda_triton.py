"""The fused Triton MoDA attention against ``moda_attention(..., backend="reference")``.

Values and the gradients of q, k, v, depth_k, depth_v; fp32 and bf16 (fp16 once); T = 1, 7, 15, 33;
depth entries read and written through strides (slices of a larger buffer); the functional
forward / backward API; the dispatcher's routing (float64, a mask that needs a gradient); second order;
d = 16, 24 (not a power of two), 32; M = 0, 1, 5; S > T (decoding); GQA (G = 2, 3) and MHA;
causal and not; bool padding masks and additive per-head masks; rows with no visible key;
non-contiguous inputs; default tiles and small tiles (several query / KV / depth blocks, partial
blocks, the causal diagonal inside a block).

Runs in-process on CUDA, or on CPU when ``TRITON_INTERPRET=1`` was set before the kernels were
imported; a plain CPU ``pytest`` run executes this module in an interpreted child process
(``test_moda_triton_interpreted.py``) and skips it here.
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.kernels.interpret import kernels_run_in_process
from tests.moda.fuzz_cases import build, cases
from tests.moda.op_checks import assert_matches_reference

if not kernels_run_in_process():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (run through test_moda_triton_interpreted.py)",
                allow_module_level=True)

from depthfusion_hf.models.moda import moda_triton  # noqa: E402
from depthfusion_hf.models.moda.moda_attention import moda_attention  # noqa: E402
from depthfusion_hf.models.moda.moda_triton import triton_moda_attention  # noqa: E402

# The package re-exports the function ``moda_attention`` under the module's name: fetch the module.
moda_op = importlib.import_module("depthfusion_hf.models.moda.moda_attention")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("out", "dq", "dk", "dv", "ddepth_k", "ddepth_v")
# Relative RMS error bounds (fla style). fp32: the kernel only reorders fp32 sums. bf16: inputs are
# the same bf16 values for both sides; the kernel rounds P to bf16 before P @ V (as FlashAttention
# does) and returns bf16 outputs / gradients, the reference stays in fp32.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_2 / max(||ref||_2, tiny): 0 for a perfect match, ~1.4 for an unrelated tensor."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def make_inputs(B: int, Hq: int, Hkv: int, T: int, S: int, M: int, d: int, dtype: torch.dtype, seed: int = 0):
    """q [B, Hq, T, d], k/v [B, Hkv, S, d], depth_k/depth_v [B, Hkv, T, M, d], leaf tensors on DEVICE."""
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_()

    return leaf(B, Hq, T, d), leaf(B, Hkv, S, d), leaf(B, Hkv, S, d), leaf(B, Hkv, T, M, d), leaf(B, Hkv, T, M, d)


def check_against_reference(inputs, attention_mask=None, scale=None, causal=True, **blocks):
    """Run the kernel forward + backward and compare values and all five gradients with the float64
    reference (tolerances scaled to dtype and inputs, tests/moda/op_checks.py)."""
    dtype = inputs[0].dtype
    out = triton_moda_attention(*inputs, attention_mask, scale, causal, **blocks)
    assert out.shape == inputs[0].shape and out.dtype == dtype
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    grads = torch.autograd.grad(out, inputs, grad_out)

    scale = inputs[0].shape[-1] ** -0.5 if scale is None else scale
    mask = None if attention_mask is None else attention_mask.cpu()
    assert_matches_reference(out.cpu(), [g.cpu() for g in grads], [x.detach().cpu() for x in inputs], grad_out.cpu(),
                             mask, scale, causal)
    return out, grads


def test_available_and_wired_into_the_op():
    assert moda_triton.moda_triton_available()
    assert moda_op.triton_moda_attention is triton_moda_attention
    assert moda_op.resolve_backend(None, torch.device(DEVICE)) == ("triton" if DEVICE == "cuda" else "torch")
    with pytest.raises(ValueError, match="backend='triton' runs on CUDA tensors"):
        moda_op.resolve_backend("triton", torch.device("meta"))
    assert not moda_op.moda_saving_supported(torch.empty(1, 1, 1, 4, device="meta"), None, "triton")


# (B, Hq, Hkv, T, S, M, d)
SHAPES = [
    (1, 2, 2, 1, 1, 1, 16),  # T = S = 1, MHA
    (2, 4, 2, 1, 9, 5, 24),  # decoding step: T = 1, S > T, GQA, d not a power of two
    (2, 4, 2, 7, 7, 0, 32),  # M = 0: plain causal attention
    (1, 4, 2, 15, 20, 5, 24),  # S > T (chunked prefill)
    (1, 6, 2, 7, 12, 1, 16),  # G = 3 (padded to 4 rows per token)
    (1, 2, 1, 33, 33, 2, 32),  # T = 33
]
SHAPE_IDS = [f"B{b}-H{hq}x{hkv}-T{t}-S{s}-M{m}-d{d}" for b, hq, hkv, t, s, m, d in SHAPES]
# Small tiles: several query / KV / depth blocks, partial last blocks, the causal diagonal inside a block.
BLOCKS = {"default": {}, "small-dot": {"block_t": 4, "block_s": 16, "depth_dot": True},
          "small-rowwise": {"block_t": 4, "block_s": 16, "depth_dot": False}}


@pytest.mark.parametrize("blocks", list(BLOCKS), ids=list(BLOCKS))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fp32_matches_reference(shape, blocks):
    check_against_reference(make_inputs(*shape, torch.float32), **BLOCKS[blocks])


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], SHAPES[4]], ids=[SHAPE_IDS[1], SHAPE_IDS[3], SHAPE_IDS[4]])
def test_bf16_matches_reference(shape):
    check_against_reference(make_inputs(*shape, torch.bfloat16), block_t=4, block_s=16)


def test_fp16_matches_reference():
    check_against_reference(make_inputs(1, 4, 2, 15, 20, 5, 24, torch.float16), block_t=4, block_s=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bool_padding_mask(dtype):
    """Left padding as the model builds it: [B, 1, 1, S] bool, batch row 0 padded on its first 6 keys."""
    B, Hq, Hkv, T, S, M, d = 2, 4, 2, 15, 20, 1, 24
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device=DEVICE)
    mask[0, ..., :6] = False
    check_against_reference(make_inputs(B, Hq, Hkv, T, S, M, d, dtype), attention_mask=mask,
                            block_t=4, block_s=16)


def test_additive_per_head_mask_non_causal_custom_scale():
    """Additive float mask [B, Hq, T, S] (different per head, some -inf), causal=False, scale != 1/sqrt(d)."""
    B, Hq, Hkv, T, S, M, d = 1, 4, 2, 7, 12, 3, 16
    g = torch.Generator().manual_seed(3)
    mask = torch.randn(B, Hq, T, S, generator=g)
    mask[torch.rand(B, Hq, T, S, generator=g) < 0.3] = float("-inf")
    check_against_reference(make_inputs(B, Hq, Hkv, T, S, M, d, torch.float32), attention_mask=mask.to(DEVICE),
                            scale=0.3, causal=False, block_t=4, block_s=16)


def test_rows_without_visible_keys():
    """M = 0 and a fully masked row gives zeros and zero gradients; with M > 0 the same row reads only depth."""
    B, Hq, Hkv, T, S, d = 1, 2, 1, 7, 7, 16
    mask = torch.ones(1, 1, T, S, dtype=torch.bool, device=DEVICE)
    mask[..., 2, :] = False
    inputs = make_inputs(B, Hq, Hkv, T, S, 0, d, torch.float32)
    out, grads = check_against_reference(inputs, attention_mask=mask)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert torch.equal(grads[0][:, :, 2], torch.zeros_like(grads[0][:, :, 2]))

    inputs = make_inputs(B, Hq, Hkv, T, S, 2, d, torch.float32)
    out, _ = check_against_reference(inputs, attention_mask=mask)
    q, depth_k, depth_v = inputs[0], inputs[3], inputs[4]
    probs = torch.softmax((q[0, :, 2] @ depth_k[0, 0, 2].T) / math.sqrt(d), dim=-1)  # (Hq, M)
    torch.testing.assert_close(out[0, :, 2], probs @ depth_v[0, 0, 2], rtol=1e-5, atol=1e-5)


def test_non_contiguous_inputs():
    """The model passes transposed views ([B, T, H, d] -> [B, H, T, d]); strides are read, not assumed."""
    B, Hq, Hkv, T, S, M, d = 1, 4, 2, 7, 9, 2, 24
    g = torch.Generator().manual_seed(5)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DEVICE).requires_grad_()

    q_, k_, v_ = leaf(B, T, Hq, d), leaf(B, S, Hkv, d), leaf(B, S, Hkv, d)
    dk_, dv_ = leaf(B, T, M, Hkv, d), leaf(B, T, M, Hkv, d)
    views = (q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2),
             dk_.permute(0, 3, 1, 2, 4), dv_.permute(0, 3, 1, 2, 4))
    assert not any(x.is_contiguous() for x in views)
    out = triton_moda_attention(*views, None, None, True, block_t=4, block_s=16)
    ref = moda_attention(*views, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn(out.shape, generator=g).to(DEVICE)
    got = torch.autograd.grad(out, (q_, k_, v_, dk_, dv_), grad_out)
    want = torch.autograd.grad(ref, (q_, k_, v_, dk_, dv_), grad_out)
    for name, a, b in zip(NAMES[1:], got, want):
        assert rel_rms(a, b) < TOL[torch.float32], name


def test_dispatch_through_moda_attention_and_float64_routing():
    inputs = make_inputs(1, 4, 2, 7, 9, 2, 16, torch.float32)
    out = moda_attention(*inputs, backend="triton")
    assert rel_rms(out, moda_attention(*inputs, backend="reference")) < TOL[torch.float32]
    # float64 has no kernel: the dispatcher routes it to the PyTorch path; the kernel entry refuses it.
    inputs64 = [x.detach().double().requires_grad_() for x in inputs]
    out64 = moda_attention(*inputs64, backend="triton")
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, moda_attention(*inputs64, backend="reference"))
    with pytest.raises(ValueError, match="float64"):
        triton_moda_attention(*inputs64, None, None, True)


def buffer_slices(B, Hkv, T, d, dtype, lo, hi, m_max=7, seed=11):
    """depth_k / depth_v as ``buffer[:, :, :, lo:hi]`` of token-major [B, Hkv, T, m_max, d] leaf buffers."""
    g = torch.Generator().manual_seed(seed)
    bufs = [torch.randn(B, Hkv, T, m_max, d, generator=g).to(DEVICE, dtype).requires_grad_() for _ in range(2)]
    return bufs, [b[:, :, :, lo:hi] for b in bufs]


@pytest.mark.parametrize("blocks", list(BLOCKS), ids=list(BLOCKS))
@pytest.mark.parametrize("lo,hi", [(2, 5), (0, 6), (3, 3)], ids=["middle", "prefix", "empty"])
def test_depth_read_and_written_through_strides(blocks, lo, hi):
    """Depth entries that are a slice of a larger buffer (not contiguous): values and gradients, the
    buffer's gradient outside the slice is zero."""
    B, Hq, Hkv, T, S, d = 2, 4, 2, 7, 9, 24
    q, k, v, _, _ = make_inputs(B, Hq, Hkv, T, S, 0, d, torch.float32)
    bufs, (dk, dv) = buffer_slices(B, Hkv, T, d, torch.float32, lo, hi)
    assert hi == lo or not dk.is_contiguous()
    out = triton_moda_attention(q, k, v, dk, dv, None, None, True, **BLOCKS[blocks])
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = torch.autograd.grad(out, (q, k, v, *bufs), grad_out)
    ref = moda_attention(q, k, v, dk, dv, backend="reference")
    want = torch.autograd.grad(ref, (q, k, v, *bufs), grad_out)
    assert rel_rms(out, ref) < TOL[torch.float32]
    for name, a, b in zip(("dq", "dk", "dv", "dbuf_k", "dbuf_v"), got, want):
        if b.abs().max() > 0:
            assert rel_rms(a, b) < TOL[torch.float32], name
    for grad_buf in got[3:]:
        outside = torch.cat([grad_buf[:, :, :, :lo], grad_buf[:, :, :, hi:]], dim=3)
        assert torch.equal(outside, torch.zeros_like(outside))  # never written by the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_saving_and_backward_from(dtype):
    """The functional API (no autograd graph) on a strided depth slice, against the reference."""
    B, Hq, Hkv, T, S, d = 1, 6, 2, 5, 8, 16
    q, k, v, _, _ = make_inputs(B, Hq, Hkv, T, S, 0, d, dtype)
    _, (dk, dv) = buffer_slices(B, Hkv, T, d, dtype, 1, 4)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device=DEVICE)
    mask[..., :2] = False
    assert moda_op.moda_saving_supported(q, mask, "triton")
    out, saved = moda_op.moda_forward_saving(q, k, v, dk, dv, mask, 0.4, True, "triton")
    assert out.grad_fn is None and out.dtype == dtype
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    grads = moda_op.moda_backward_from(saved, grad_out)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, dk, dv)]
    ref = moda_attention(*leaves, attention_mask=mask, scale=0.4, backend="reference")
    want = torch.autograd.grad(ref, leaves, grad_out.float())
    assert rel_rms(out, ref) < TOL[dtype]
    for name, got, exp in zip(NAMES[1:], grads, want):
        assert got.shape == exp.shape and got.dtype == dtype, name
        assert rel_rms(got, exp) < TOL[dtype], name
    partial = moda_op.moda_backward_from(saved, grad_out, needs=(False, False, False, True, True))
    assert partial[:3] == (None, None, None)
    torch.testing.assert_close(partial[3], grads[3], rtol=0, atol=0)  # the same kernel, the same sums


@pytest.mark.parametrize("depth_dot", [True, False], ids=["dot", "rowwise"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["into-fp32", "into-bf16"])
def test_backward_adds_depth_gradients_into_a_strided_buffer(depth_dot, grad_dtype):
    """``depth_grads_into``: the kernel adds the depth gradients into slices of a gradient buffer
    (written through strides, in the buffer's dtype); entries outside the slice keep their values."""
    B, Hq, Hkv, T, S, d, lo, hi = 1, 4, 2, 9, 11, 16, 2, 5
    q, k, v, _, _ = make_inputs(B, Hq, Hkv, T, S, 0, d, torch.bfloat16)
    _, (dk, dv) = buffer_slices(B, Hkv, T, d, torch.bfloat16, lo, hi)
    g = torch.Generator().manual_seed(8)
    grad_bufs = [torch.randn(B, Hkv, T, 7, d, generator=g).to(DEVICE, grad_dtype) for _ in range(2)]
    before = [b.clone() for b in grad_bufs]
    out, saved = moda_op.moda_forward_saving(q, k, v, dk, dv, None, 0.25, True, "triton")
    saved.state[2]["BLOCK_T"], saved.state[2]["DEPTH_DOT"] = 8, depth_dot  # 2 query blocks (16 rows), both forms
    grad_out = torch.randn(out.shape, generator=g).to(DEVICE, torch.bfloat16)
    into = tuple(b[:, :, :, lo:hi] for b in grad_bufs)
    grads = moda_op.moda_backward_from(saved, grad_out, needs=(True, False, False, False, False),
                                       depth_grads_into=into)
    assert grads[1] is None and grads[3] is into[0] and grads[4] is into[1]
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, dk, dv)]
    ref = moda_attention(*leaves, scale=0.25, backend="reference")
    want = torch.autograd.grad(ref, leaves, grad_out.float())
    assert rel_rms(grads[0], want[0]) < TOL[torch.bfloat16]
    for buf, old, exp in zip(grad_bufs, before, want[3:]):
        added = buf[:, :, :, lo:hi].double() - old[:, :, :, lo:hi].double()
        # bf16 buffer: the sum is rounded once more; its error is relative to the buffer's magnitude.
        err = (added - exp.double()).norm() / exp.double().norm()
        bound = TOL[torch.bfloat16] * (1 if grad_dtype == torch.float32 else 1 + old.float().norm() / exp.norm())
        assert err < bound
        assert torch.equal(buf[:, :, :, :lo], old[:, :, :, :lo]) and torch.equal(buf[:, :, :, hi:], old[:, :, :, hi:])
    with pytest.raises(ValueError, match="depth_grads_into gk must be a floating tensor of depth_k's shape"):
        moda_op.moda_backward_from(saved, grad_out, depth_grads_into=(grad_bufs[0], grad_bufs[1]))


def test_mask_gradient_agrees_with_the_pytorch_path():
    """A float mask that requires grad: backend='triton' routes to the PyTorch path and returns its gradient."""
    B, Hq, Hkv, T, S, M, d = 1, 4, 2, 5, 7, 2, 16
    inputs = make_inputs(B, Hq, Hkv, T, S, M, d, torch.float32)
    mask = torch.randn(B, 1, T, S, generator=torch.Generator().manual_seed(6)).to(DEVICE).requires_grad_()
    out = moda_attention(*inputs, attention_mask=mask, backend="triton")
    (got,) = torch.autograd.grad(out.sum(), [mask])
    ref = moda_attention(*inputs, attention_mask=mask, backend="reference")
    (want,) = torch.autograd.grad(ref.sum(), [mask])
    assert want.abs().max() > 0 and rel_rms(got, want) < TOL[torch.float32]


def test_second_order_gradients():
    """create_graph=True through backend='triton': the gradient of a gradient norm matches the reference;
    the kernel entry without a second-order implementation refuses with a clear error."""
    B, Hq, Hkv, T, S, M, d = 1, 4, 2, 5, 7, 2, 16
    inputs = make_inputs(B, Hq, Hkv, T, S, M, d, torch.float32)

    def grad_of_grad_norm(fn):
        out = fn(*inputs)
        first = torch.autograd.grad(out.pow(2).sum(), inputs, create_graph=True)
        return torch.autograd.grad(sum(g.pow(2).sum() for g in first), inputs)

    got = grad_of_grad_norm(lambda *x: moda_attention(*x, backend="triton"))
    want = grad_of_grad_norm(lambda *x: moda_attention(*x, backend="reference"))
    for name, a, b in zip(NAMES[1:], got, want):
        assert rel_rms(a, b) < 10 * TOL[torch.float32], name
    out = triton_moda_attention(*inputs, None, None, True)
    with pytest.raises(RuntimeError, match="second-order gradients.*backend='torch'"):
        torch.autograd.grad(out.sum(), inputs, create_graph=True)


TRITON_FUZZ = settings(max_examples=int(os.environ.get("MODA_TRITON_FUZZ_EXAMPLES", "12")), deadline=None,
                       derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


@TRITON_FUZZ
@given(case=cases(max_t=5, max_d=9))
def test_fuzz_public_op_triton_backend(case):
    """Drawn shapes, layouts, dtypes and masks (tests/moda/fuzz_cases.py) through backend="triton" (the
    kernels; float64 and mask-gradient calls routed to the PyTorch path) against the float64 reference."""
    inputs, mask, grad_out = build(case)
    inputs = [x.to(DEVICE) for x in inputs]  # no copy on CPU: the drawn strides reach the kernel
    mask = None if mask is None else mask.to(DEVICE)
    out = moda_attention(*inputs, attention_mask=mask, scale=case.scale, causal=case.causal, backend="triton")
    wrt = inputs + ([mask] if mask is not None and mask.requires_grad else [])
    grads = torch.autograd.grad(out, wrt, grad_out.to(DEVICE))
    assert_matches_reference(out.cpu(), [g.cpu() for g in grads], [x.cpu() for x in inputs], grad_out,
                             None if mask is None else mask.cpu(), case.scale, case.causal)


@TRITON_FUZZ
@given(case=cases(dtypes=(torch.float32, torch.bfloat16), masks=("none", "bool_padding", "bool_rows", "additive"),
                  max_t=5, max_d=9))
def test_fuzz_functional_triton(case):
    """The functional forward / backward API on the Triton kernels, drawn cases."""
    inputs, mask, grad_out = build(case)
    inputs = [x.detach().to(DEVICE) for x in inputs]
    mask = None if mask is None else mask.to(DEVICE)
    out, saved = moda_op.moda_forward_saving(*inputs, mask, case.scale, case.causal, "triton")
    grads = moda_op.moda_backward_from(saved, grad_out.to(DEVICE))
    assert_matches_reference(out.cpu(), [g.cpu() for g in grads], [x.cpu() for x in inputs], grad_out,
                             None if mask is None else mask.cpu(), case.scale, case.causal)


def test_comparison_detects_wrong_semantics():
    """The checks above can fail: dropping depth entries, causality or GQA mapping moves the output."""
    B, Hq, Hkv, T, S, M, d = 1, 4, 2, 7, 9, 2, 16
    q, k, v, dk, dv = make_inputs(B, Hq, Hkv, T, S, M, d, torch.float32)
    out = triton_moda_attention(q, k, v, dk, dv, None, None, True).detach()
    ref = moda_attention(q, k, v, dk, dv, backend="reference").detach()
    assert rel_rms(out, ref) < TOL[torch.float32]
    no_depth = moda_attention(q, k, v, dk[:, :, :, :0], dv[:, :, :, :0], backend="reference").detach()
    non_causal = moda_attention(q, k, v, dk, dv, causal=False, backend="reference").detach()
    swapped_heads = moda_attention(q, k.flip(1), v.flip(1), dk.flip(1), dv.flip(1), backend="reference").detach()
    for wrong in (no_depth, non_causal, swapped_heads):
        assert rel_rms(out, wrong) > 100 * TOL[torch.float32]
