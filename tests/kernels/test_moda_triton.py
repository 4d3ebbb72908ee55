"""The fused Triton MoDA attention against ``moda_attention(..., backend="reference")`` in float64.

The launchers (``triton_moda_forward`` / ``triton_moda_backward``) on small shapes with default and small tiles
(several query / KV / depth blocks, partial blocks, the causal diagonal inside a block, both depth forms), fp32
(TF32 allowed), bf16 and fp16, masks, rows with no visible key, strided inputs; the public op on
``backend="triton"``: what it routes to the PyTorch path (float64, a mask that needs a gradient; fp32 without
TF32 stays, with IEEE dots), one compute dtype under autocast (RoPE leaves q, k in fp32 and v in bf16), second
order; and the findings of issue 20 that a CPU can check: 64-bit offsets (real launches whose token and
depth-slot offsets pass 2**31 elements, on sparse memory), the folded grid, the device guard, NaN keys behind the mask.

Runs in-process on CUDA, or on CPU when ``TRITON_INTERPRET=1`` was set before the kernels were imported; a plain
CPU ``pytest`` run executes this module in an interpreted child process (``test_moda_triton_interpreted.py``).
Interpreted kernels are slow: the shapes stay small.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.kernels.interpret import kernels_run_in_process
from tests.moda.fuzz_cases import build, cases, op_depth
from tests.moda.op_checks import assert_matches_reference

if not kernels_run_in_process():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (run through test_moda_triton_interpreted.py)",
                allow_module_level=True)

from depthfusion_hf.models import moda_triton  # noqa: E402
from depthfusion_hf.models.moda_attention import moda_attention, resolve_backend  # noqa: E402
from depthfusion_hf.models.moda_triton import triton_moda_backward, triton_moda_forward  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def tf32_allowed():
    """The kernels' fp32 dots are TF32: allowed here (the interpreter computes them in fp32 anyway)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(previous)


def make_inputs(B, Hq, Hkv, T, S, M, d, dtype, seed=0):
    """q [B, Hq, T, d], k/v [B, Hkv, S, d], depth_k/depth_v [B, Hkv, T, M, d] on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, Hq, T, d), (B, Hkv, S, d), (B, Hkv, S, d), (B, Hkv, T, M, d), (B, Hkv, T, M, d)]
    return [torch.randn(s, generator=g).to(DEVICE, dtype) for s in shapes]


def kernels(inputs, attention_mask=None, scale=None, causal=True, **blocks):
    """The two launchers (depth token-major views of the [B, Hkv, T, M, d] inputs): out and the five gradients."""
    q, k, v, depth_k, depth_v = inputs
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    depth = [x.transpose(1, 2) for x in (depth_k, depth_v)]  # [B, T, Hkv, M, d] views
    out, lse, renorm = triton_moda_forward(q, k, v, *depth, attention_mask, scale, causal, **blocks)
    assert renorm is None or torch.equal(renorm, torch.ones_like(renorm))  # only mask-sized rows are renormalised
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    grads = triton_moda_backward(grad_out, q, k, v, *depth, attention_mask, out, lse, scale, causal, **blocks)
    dq, dk, dv, _, ddk, ddv, dgate = grads
    assert dgate is None
    return out, lse, grad_out, [dq, dk, dv, ddk.transpose(1, 2), ddv.transpose(1, 2)]


def check_kernels(inputs, attention_mask=None, scale=None, causal=True, **blocks):
    out, lse, grad_out, grads = kernels(inputs, attention_mask, scale, causal, **blocks)
    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype and lse.dtype == torch.float32
    mask = None if attention_mask is None else attention_mask.cpu()
    scale = inputs[0].shape[-1] ** -0.5 if scale is None else scale
    assert_matches_reference(out.cpu(), [g.cpu() for g in grads], [x.cpu() for x in inputs], grad_out.cpu(), mask,
                             scale, causal)
    return out, lse, grads


def test_available_and_wired_into_the_op():
    assert moda_triton.moda_triton_available()
    assert resolve_backend(None, torch.device(DEVICE)) == ("triton" if DEVICE == "cuda" else "torch")
    with pytest.raises(ValueError, match="backend='triton' runs on CUDA tensors"):
        resolve_backend("triton", torch.device("meta"))


# (B, Hq, Hkv, T, S, M, d)
SHAPES = [
    (1, 2, 2, 1, 1, 1, 16),  # T = S = 1, MHA
    (2, 4, 2, 1, 9, 5, 24),  # decoding step: T = 1, S > T, GQA, d not a power of two
    (1, 4, 2, 15, 20, 5, 24),  # S > T (chunked prefill)
    (1, 6, 2, 7, 12, 1, 16),  # G = 3 (padded to 4 rows per token)
    (1, 2, 1, 33, 33, 2, 32),  # T = 33
]
SHAPE_IDS = [f"B{b}-H{hq}x{hkv}-T{t}-S{s}-M{m}-d{d}" for b, hq, hkv, t, s, m, d in SHAPES]
BLOCKS = {"default": {}, "small-dot": {"block_t": 4, "block_s": 16, "depth_dot": True},
          "small-rowwise": {"block_t": 4, "block_s": 16, "depth_dot": False}}


@pytest.mark.parametrize("blocks", list(BLOCKS), ids=list(BLOCKS))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fp32_matches_reference(shape, blocks):
    check_kernels(make_inputs(*shape, torch.float32), **BLOCKS[blocks])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("depth_dot", [True, False], ids=["dot", "rowwise"])
def test_half_precision_matches_reference(dtype, depth_dot):
    check_kernels(make_inputs(1, 4, 2, 15, 20, 5, 24, dtype), block_t=4, block_s=16, depth_dot=depth_dot)


@pytest.mark.parametrize("kind", ["padding", "additive-per-head"])
def test_masks(kind):
    """Left padding as the model builds it ([B, 1, 1, S] bool), or an additive per-head mask with -inf, not causal,
    another scale; a NaN key behind the padding contributes nothing."""
    B, Hq, Hkv, T, S, M, d = 2, 4, 2, 7, 12, 2, 16
    inputs = make_inputs(B, Hq, Hkv, T, S, M, d, torch.float32)
    g = torch.Generator().manual_seed(3)
    if kind == "padding":
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        mask[0, ..., :6] = False
        out, _, _ = check_kernels(inputs, attention_mask=mask.to(DEVICE), block_t=4, block_s=16)
        poisoned = [x.clone() for x in inputs]
        poisoned[1][0, :, 2] = float("nan")  # a padded key of batch row 0
        got, _, _, _ = kernels(poisoned, attention_mask=mask.to(DEVICE), block_t=4, block_s=16)
        assert torch.equal(got, out)
    else:
        mask = torch.randn(B, Hq, T, S, generator=g)
        mask[torch.rand(B, Hq, T, S, generator=g) < 0.3] = float("-inf")
        check_kernels(inputs, attention_mask=mask.to(DEVICE), scale=0.3, causal=False, block_t=4, block_s=16)


def test_rows_without_visible_keys():
    """M = 0 and a fully masked row gives zeros, an infinite lse and zero gradients; with M > 0 the same row reads
    only its depth entries."""
    B, Hq, Hkv, T, S, d = 1, 2, 1, 7, 7, 16
    mask = torch.ones(1, 1, T, S, dtype=torch.bool, device=DEVICE)
    mask[..., 2, :] = False
    out, lse, grads = check_kernels(make_inputs(B, Hq, Hkv, T, S, 0, d, torch.float32), attention_mask=mask)
    assert not out[:, :, 2].any() and not grads[0][:, :, 2].any() and torch.isinf(lse[:, :, 2]).all()
    inputs = make_inputs(B, Hq, Hkv, T, S, 2, d, torch.float32)
    out, _, _ = check_kernels(inputs, attention_mask=mask)
    q, depth_k, depth_v = inputs[0], inputs[3], inputs[4]
    probs = torch.softmax((q[0, :, 2] @ depth_k[0, 0, 2].T) / math.sqrt(d), dim=-1)  # (Hq, M)
    torch.testing.assert_close(out[0, :, 2], probs @ depth_v[0, 0, 2], rtol=1e-5, atol=1e-5)


def test_non_contiguous_inputs():
    """The model passes transposed views ([B, T, H, d] -> [B, H, T, d]); strides are read, not assumed."""
    B, Hq, Hkv, T, S, M, d = 1, 4, 2, 7, 9, 2, 24
    g = torch.Generator().manual_seed(5)
    q_, k_, v_ = (torch.randn(B, n, h, d, generator=g).to(DEVICE) for n, h in ((T, Hq), (S, Hkv), (S, Hkv)))
    dk_, dv_ = (torch.randn(B, T, M, Hkv, d, generator=g).to(DEVICE) for _ in range(2))
    views = [q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), dk_.permute(0, 3, 1, 2, 4),
             dv_.permute(0, 3, 1, 2, 4)]
    assert not any(x.is_contiguous() for x in views)
    check_kernels(views, block_t=4, block_s=16)


def leaves(inputs):
    return [x.detach().clone().requires_grad_() for x in inputs]


def test_the_op_routes_what_the_kernels_do_not_compute():
    """float64 and a mask that needs a gradient run on the PyTorch path (same numbers as backend="torch"); the
    launchers refuse float64. fp32 without TF32 (precision "highest") stays on the kernels, with IEEE dots on
    16-row tiles (issue 20's fp32 policy)."""
    inputs = make_inputs(1, 4, 2, 7, 9, 2, 16, torch.float32)
    f64 = [x.double() for x in inputs]
    torch.testing.assert_close(moda_attention(*f64, backend="triton"), moda_attention(*f64, backend="torch"),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="float64"):
        triton_moda_forward(*f64[:3], *(x.transpose(1, 2) for x in f64[3:]), None, 0.25, True)
    torch.set_float32_matmul_precision("highest")
    blocks, warps = moda_triton._block_sizes(2048, 2, 128, None, None, None, ieee=moda_triton._ieee(torch.float32))
    assert blocks["BLOCK_T"] * blocks["G_PAD"] == 16 and blocks["BLOCK_S"] == 16 and warps == 4
    assert moda_triton._block_sizes(2048, 2, 128, None, None, None, ieee=moda_triton._ieee(torch.bfloat16))[1] == 8
    f64_out = moda_attention(*f64, backend="reference")
    torch.testing.assert_close(moda_attention(*inputs, backend="triton").double(), f64_out, rtol=1e-5, atol=1e-6)
    torch.set_float32_matmul_precision("high")
    mask = torch.randn(1, 1, 7, 9, generator=torch.Generator().manual_seed(6)).to(DEVICE).requires_grad_()
    (got,) = torch.autograd.grad(moda_attention(*inputs, attention_mask=mask, backend="triton").sum(), [mask])
    (want,) = torch.autograd.grad(moda_attention(*inputs, attention_mask=mask, backend="reference").sum(), [mask])
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_one_compute_dtype_under_autocast(dtype):
    """Under autocast RoPE leaves q and k in fp32 while v and the FFN entries come out of a linear in the half type:
    the op casts all of them to the autocast dtype at its boundary (the backward kernels failed to compile with
    "Both operands must be same dtype" at their dots), values and gradients as for inputs given in that dtype."""
    q, k, v, dk, dv = leaves(make_inputs(1, 4, 2, 7, 9, 3, 16, torch.float32))
    v_half, dv_half = (x.detach().to(dtype).requires_grad_() for x in (v, dv))
    with torch.autocast(DEVICE, dtype=dtype):
        out = moda_attention(q, k, v_half, list(dk.unbind(3)), list(dv_half.unbind(3)), backend="triton")
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, [q, k, v_half, dk, dv_half], torch.ones_like(out))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, dtype, torch.float32, dtype]
    same = leaves([x.to(dtype) for x in (q, k, v_half, dk, dv_half)])
    want = moda_attention(*same, backend="triton")
    assert torch.equal(out, want)
    for got, exp in zip(grads, torch.autograd.grad(want, same, torch.ones_like(want))):
        assert torch.equal(got.to(dtype), exp)


def test_second_order_gradients():
    """create_graph=True through backend="triton": the differentiable PyTorch backward runs on the kernel's saved
    output and log-sum-exp; the gradient of a gradient norm matches the reference."""
    inputs = leaves(make_inputs(1, 4, 2, 5, 7, 2, 16, torch.float32))

    def grad_of_grad_norm(backend):
        out = moda_attention(*inputs, backend=backend)
        first = torch.autograd.grad(out.pow(2).sum(), inputs, create_graph=True)
        return torch.autograd.grad(sum(g.pow(2).sum() for g in first), inputs)

    for got, want in zip(grad_of_grad_norm("triton"), grad_of_grad_norm("reference")):
        assert (got - want).norm() <= 1e-4 * want.norm()


def sparse(path, elements, dtype):
    """A tensor of ``elements`` elements on a sparse file: addressable past 2**31 elements, only what is touched
    takes memory."""
    return torch.from_file(str(path), shared=True, size=elements, dtype=dtype)


@pytest.mark.skipif(DEVICE != "cpu", reason="sparse host memory: the interpreter's check (CUDA: gpu_check.sh)")
def test_offsets_past_2_31_elements(tmp_path):
    """Index x stride products that pass 2**31 while each factor fits int32 (here a depth-slot stride and a token
    stride of 2**30 + 64, read at index 2): with 32-bit arithmetic they wrap and the kernels read other memory."""
    B, Hq, Hkv, T, S, M, d = 1, 2, 1, 3, 3, 3, 16
    stride = 2**30 + 64
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(s, generator=g).half() for s in [(B, Hq, T, d), (B, Hkv, S, d), (B, Hkv, S, d),
                                                           (B, Hkv, T, M, d), (B, Hkv, T, M, d)]]
    q = sparse(tmp_path / "q", 2 * stride + Hq * d, torch.float16).as_strided((B, Hq, T, d), (0, d, stride, 1))
    depth = [sparse(tmp_path / name, 2 * stride + T * Hkv * d, torch.float16).as_strided(
        (B, Hkv, T, M, d), (0, d, Hkv * d, stride, 1)) for name in ("dk", "dv")]
    views = [q, dense[1], dense[2], *depth]
    for view, values in zip(views, dense):
        view.copy_(values)
    assert max(x.storage_offset() + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) for x in views) > 2**31
    out, _, grad_out, grads = kernels(views, block_t=4, block_s=16, depth_dot=False)
    assert_matches_reference(out, grads, dense, grad_out, None, d**-0.5, True)
    out, _, grad_out, grads = kernels(views, block_t=4, block_s=16, depth_dot=True)
    assert_matches_reference(out, grads, dense, grad_out, None, d**-0.5, True)


def test_the_grid_is_one_axis_that_cannot_overflow():
    """B x Hkv past 65535 (axis 1's limit) still launches: every program sits on axis 0 (limit 2**31 - 1)."""
    assert moda_triton.launch_grid(3, 70_000) == (210_000,)
    with pytest.raises(ValueError, match="exceed CUDA's 2\\*\\*31 - 1"):
        moda_triton.launch_grid(2**16, 2**16)


def test_launches_are_guarded_by_the_tensors_device():
    """A CUDA tensor on cuda:1 launches inside ``torch.cuda.device(1)`` (so on that device's current stream)."""
    guard = moda_triton._device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert not isinstance(moda_triton._device_guard(torch.device("cpu")), torch.cuda.device)


TRITON_FUZZ = settings(max_examples=int(os.environ.get("MODA_TRITON_FUZZ_EXAMPLES", "10")), deadline=None,
                       derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


@TRITON_FUZZ
@given(case=cases(max_t=5, max_d=9))
def test_fuzz_public_op_triton_backend(case):
    """Drawn shapes, layouts, dtypes, masks and scales (tests/moda/fuzz_cases.py) through backend="triton" (float64
    and mask-gradient calls routed to the PyTorch path) against the float64 reference."""
    inputs, mask, grad_out = build(case)
    inputs = [x.to(DEVICE) for x in inputs]  # no copy on CPU: the drawn strides reach the kernel
    mask = None if mask is None else mask.to(DEVICE)
    out = moda_attention(*inputs[:3], *op_depth(case, inputs), attention_mask=mask, scale=case.scale,
                         causal=case.causal, backend="triton")
    wrt = inputs + ([mask] if mask is not None and mask.requires_grad else [])
    grads = torch.autograd.grad(out, wrt, grad_out.to(DEVICE), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, wrt)]
    assert_matches_reference(out.cpu(), [g.cpu() for g in grads], [x.cpu() for x in inputs], grad_out,
                             None if mask is None else mask.cpu(), case.scale, case.causal)


def test_comparison_detects_wrong_semantics():
    """The checks above can fail: dropping depth entries, causality or the GQA mapping moves the output."""
    inputs = make_inputs(1, 4, 2, 7, 9, 2, 16, torch.float32)
    out, _, _, _ = kernels(inputs)
    q, k, v, dk, dv = inputs
    for wrong in (moda_attention(q, k, v, dk[:, :, :, :0], dv[:, :, :, :0], backend="reference"),
                  moda_attention(q, k, v, dk, dv, causal=False, backend="reference"),
                  moda_attention(q, k.flip(1), v.flip(1), dk.flip(1), dv.flip(1), backend="reference")):
        assert (out - wrong).norm() > 1e-2 * wrong.norm()


@pytest.mark.parametrize("blocks", list(BLOCKS), ids=list(BLOCKS))
def test_depth_gate_matches_reference(blocks):
    """The depth gate (issue 28): head h's depth scores times g_h, g = 0 included (exactly the sequence attention);
    values and gradients, the gate's too (its closed-head gradient is finite and non-zero), against the float64
    reference, both depth-phase forms."""
    B, Hq, Hkv, T, S, M, d = 1, 4, 2, 7, 9, 3, 16
    inputs = make_inputs(B, Hq, Hkv, T, S, M, d, torch.float32)
    gate = torch.tensor([0.0, 0.4, 1.0, 2.5], device=DEVICE)
    q, k, v, depth_k, depth_v = inputs
    depth = [x.transpose(1, 2) for x in (depth_k, depth_v)]
    out, lse, renorm = triton_moda_forward(q, k, v, *depth, None, d**-0.5, True, gate, **BLOCKS[blocks])
    assert renorm is None
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    dq, dk, dv, _, ddk, ddv, dgate = triton_moda_backward(grad_out, q, k, v, *depth, None, out, lse, d**-0.5, True,
                                                          gate, **BLOCKS[blocks])
    leaves = [x.detach().cpu().double().requires_grad_() for x in (*inputs, gate)]
    want = moda_attention(*leaves[:5], depth_gate=leaves[5], backend="reference")
    want_grads = torch.autograd.grad(want, leaves, grad_out.cpu().double())
    got = [out, dq, dk, dv, ddk.transpose(1, 2), ddv.transpose(1, 2), dgate]
    for name, g, w in zip(("out", "q", "k", "v", "depth_k", "depth_v", "gate"), got, [want, *want_grads]):
        err, size = (g.cpu().double() - w).norm().item(), w.norm().item()
        assert err <= 2e-5 * size + 1e-6, f"{name}: error {err:.3e}, norm {size:.3e}"
    assert want_grads[5][0].abs() > 1e-3  # the closed head learns
    no_depth, _, _ = triton_moda_forward(q, k, v, *(x[..., :0, :] for x in depth), None, d**-0.5, True)
    torch.testing.assert_close(out[:, 0], no_depth[:, 0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_depth", [False, True], ids=["no-depth", "closed-gate"])
def test_rows_of_only_finfo_min_keys_are_their_mean(with_depth):
    """Issue 27: an eager padding row (every key at finfo.min) is the mean of its keys' values, with the reference's
    gradients (finfo.min * log2(e) overflowed to -inf: the kernels returned zeros; the backward now scales the
    row's incoming gradient by the renormaliser the forward returns)."""
    B, Hq, Hkv, T, S, d = 2, 2, 1, 5, 5, 16
    inputs = make_inputs(B, Hq, Hkv, T, S, 2 if with_depth else 0, d, torch.float32)
    low = torch.finfo(torch.float32).min
    mask = torch.zeros(B, 1, T, S).masked_fill(torch.ones(T, S, dtype=torch.bool).triu(1), low)
    mask[1, :, :3, :] = low  # left padding of 3 in batch row 1
    mask = mask.to(DEVICE)
    gate = torch.zeros(Hq, device=DEVICE) if with_depth else None
    grad_out = torch.randn(B, Hq, T, d, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    wrt = leaves(inputs)
    out = moda_attention(*wrt, attention_mask=mask, backend="triton", depth_gate=gate)
    grads = torch.autograd.grad(out, wrt, grad_out)
    torch.testing.assert_close(out[1, :, 2], inputs[2][1, 0, :3].mean(0).expand(Hq, -1), rtol=1e-5, atol=1e-6)
    ref = [x.detach().cpu().double().requires_grad_() for x in inputs]
    want = moda_attention(*ref, attention_mask=mask.cpu(), backend="reference",
                          depth_gate=None if gate is None else gate.cpu().double())
    want_grads = torch.autograd.grad(want, ref, grad_out.cpu().double())
    for g, w in zip([out, *grads], [want, *want_grads]):
        torch.testing.assert_close(g.cpu().double(), w, rtol=1e-5, atol=1e-5)
