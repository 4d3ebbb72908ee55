"""moda_attention's fused CPU path (SDPA flash kernel + depth pool, merged by log-sum-exp) and the
materialised PyTorch path, each against the reference loop: values and gradients."""

from __future__ import annotations

import importlib

import pytest
import torch

from depthfusion_hf.models.moda.moda_attention import moda_reference, moda_torch_flash_cpu, moda_torch_math
from tests.moda.op_checks import assert_matches_reference

moda_module = importlib.import_module("depthfusion_hf.models.moda.moda_attention")
PATHS = {"flash_cpu": moda_torch_flash_cpu, "math": moda_torch_math}


def _inputs(B=2, Hq=4, Hkv=2, T=7, S=None, M=3, d=8, dtype=torch.float32, seed=0):
    """q [B, Hq, T, d] (stored [B, T, Hq, d] as in the model), k, v [B, Hkv, S, d], depth [B, Hkv, T, M, d]."""
    gen = torch.Generator().manual_seed(seed)
    S = T + 3 if S is None else S
    q = torch.randn(B, T, Hq, d, generator=gen).transpose(1, 2).to(dtype).requires_grad_()
    rest = [(B, Hkv, S, d), (B, Hkv, S, d), (B, Hkv, T, M, d), (B, Hkv, T, M, d)]
    return [q] + [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in rest]


def _compare(path, inputs, mask=None, causal=True, scale=None):
    """``path`` against the float64 reference on the same values: output and all five gradients, with
    tolerances scaled to the dtype and the inputs (tests/moda/op_checks.py)."""
    scale = inputs[0].shape[-1] ** -0.5 if scale is None else scale
    grad = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(inputs[0].dtype)
    out = PATHS[path](*inputs, mask, scale, causal)
    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
    grads = torch.autograd.grad(out, inputs, grad)
    assert all(g.dtype == inputs[0].dtype for g in grads)
    assert_matches_reference(out, grads, inputs, grad, mask, scale, causal)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 7, 63])
@pytest.mark.parametrize("M", [0, 1, 12])
@pytest.mark.parametrize("extra", [0, 5])  # S = T (prefill) and S > T (cached decoding)
def test_matches_reference(path, dtype, T, M, extra):
    _compare(path, _inputs(T=T, S=T + extra, M=M, dtype=dtype))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("Hq,Hkv", [(3, 3), (6, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S", [5, 9])
def test_gqa_non_causal_and_long_cache(path, Hq, Hkv, causal, S):
    _compare(path, _inputs(Hq=Hq, Hkv=Hkv, T=5, S=S, M=2, d=12), causal=causal)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kind", ["bool", "additive", "per_head", "2d"])
@pytest.mark.parametrize("M", [0, 4])
@pytest.mark.parametrize("S", [6, 9])
def test_masks_and_rows_without_sequence_keys(path, kind, M, S):
    inputs = _inputs(B=2, Hq=4, Hkv=2, T=6, S=S, M=M)
    gen = torch.Generator().manual_seed(2)
    keep = torch.rand(2, 1, 6, S, generator=gen) > 0.4
    keep[0, 0, 2] = False  # a row with no visible sequence key: the depth entries get all the mass (or zeros)
    keep[1, 0, 4, : S - 2] = False  # a row whose only visible keys lie beyond its causal horizon
    if kind == "bool":
        mask = keep
    elif kind == "additive":
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) + 0.1 * torch.randn(keep.shape, generator=gen)
    elif kind == "per_head":
        mask = torch.randn(1, 4, 6, S, generator=gen)
    else:
        mask = keep[0, 0]  # [T, S]
    _compare(path, inputs, mask=mask)


def test_scale_and_large_logits():
    inputs = [(x * 4).detach().requires_grad_() for x in _inputs(T=9, S=12, M=5)]
    _compare("flash_cpu", inputs, scale=0.7)


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_float64(causal):
    inputs = [x.detach().double().requires_grad_() for x in _inputs(B=1, Hq=2, Hkv=1, T=3, S=5, M=2, d=4)]
    mask = torch.tensor([True, False, True, True, True]).view(1, 1, 1, 5)

    def f(*x):
        return moda_torch_flash_cpu(*x, mask, 0.5, causal)

    assert torch.autograd.gradcheck(f, inputs)


def test_gradcheck_float64_no_depth_and_empty_row():
    inputs = [x.detach().double().requires_grad_() for x in _inputs(B=1, Hq=2, Hkv=2, T=3, S=3, M=1, d=4)]
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = False  # row 1 sees only its depth entry
    assert torch.autograd.gradcheck(lambda *x: moda_torch_flash_cpu(*x, mask, 0.5, True), inputs)


def test_row_with_no_entry_is_zero_with_finite_gradients():
    q, k, v, dk, dv = _inputs(B=1, Hq=2, Hkv=1, T=3, S=3, M=0)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = False
    out = moda_torch_flash_cpu(q, k, v, dk, dv, mask, 0.3, True)
    assert out[:, :, 1].abs().max() == 0 and out[:, :, 0].abs().max() > 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_dispatch_cpu_uses_the_fused_path(monkeypatch):
    calls = []
    original = moda_module.moda_torch_flash_cpu
    monkeypatch.setattr(moda_module, "moda_torch_flash_cpu", lambda *a: calls.append(1) or original(*a))
    inputs = _inputs(T=4, S=6, M=2)
    moda_module.moda_attention(*inputs, backend="torch")
    assert calls == [1]


def test_mask_needing_gradient_takes_the_materialised_path():
    inputs = _inputs(T=4, S=6, M=2)
    mask = torch.randn(1, 1, 4, 6, requires_grad=True)
    out = moda_module.moda_attention(*inputs, attention_mask=mask, backend="torch")
    (grad_mask,) = torch.autograd.grad(out.sum(), [mask])
    expected = moda_module.moda_attention(*inputs, attention_mask=mask, backend="reference")
    torch.testing.assert_close(out, expected)
    assert grad_mask.abs().max() > 0


def test_no_grad_inference_matches():
    inputs = [x.detach() for x in _inputs(T=1, S=17, M=6)]
    with torch.no_grad():
        out = moda_torch_flash_cpu(*inputs, None, 0.35, True)
    torch.testing.assert_close(out, moda_reference(*inputs, None, 0.35, True))


def test_flop_counter_sees_the_attention_matmuls():
    from torch.utils.flop_counter import FlopCounterMode

    inputs = [x.detach() for x in _inputs(B=1, Hq=2, Hkv=2, T=4, S=4, M=0, d=8)]
    counter = FlopCounterMode(display=False)
    with counter:
        moda_module.moda_attention(*inputs, backend="torch")
    assert counter.get_total_flops() == 2 * (2 * 2 * 4 * 4 * 8)  # q.k and p.v over the full [T, S] scores


def _transposed_last(x: torch.Tensor) -> torch.Tensor:
    """The same values with a non-unit last-dim stride (a transpose of a [.., d, T] tensor)."""
    return x.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("which", [0, 1, 2, 3, 4], ids=["q", "k", "v", "depth_k", "depth_v"])
def test_inputs_not_unit_stride_in_the_last_dim(path, which):
    """The CPU flash kernel reads a non-unit last-dim stride wrong (errors of order 1 to 1e34): such
    inputs are copied for it; every path gives the reference's values and gradients."""
    inputs = _inputs(T=6, S=9, M=3)
    inputs[which] = _transposed_last(inputs[which])
    assert inputs[which].stride(-1) != 1
    _compare(path, inputs)


def test_public_op_with_transposed_and_strided_inputs():
    """moda_attention(backend="torch") on views: transposed last dims, every-other-element strides, a
    broadcast (stride 0) head dim, a depth slice of a larger buffer and a transposed mask."""
    B, Hq, Hkv, T, S, M, d = 2, 4, 2, 5, 8, 3, 8
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, Hq, d, T, generator=g).requires_grad_()
    k = torch.randn(B, Hkv, S, 2 * d, generator=g).requires_grad_()
    v = torch.randn(B, 1, S, d, generator=g).requires_grad_()
    buf_k = torch.randn(B, Hkv, T, M + 4, d, generator=g).requires_grad_()
    buf_v = torch.randn(B, Hkv, d, T, M + 4, generator=g).requires_grad_()
    mask = torch.randn(B, 1, S, T, generator=g)
    views = [q.transpose(-1, -2), k[..., ::2], v.expand(B, Hkv, S, d), buf_k[:, :, :, 2 : 2 + M],
             buf_v.permute(0, 1, 3, 4, 2)[:, :, :, 1 : 1 + M]]
    mask_view = mask.transpose(-1, -2)
    grad = torch.randn(B, Hq, T, d, generator=g)
    out = moda_module.moda_attention(*views, attention_mask=mask_view, backend="torch")
    grads = torch.autograd.grad(out, views, grad)
    assert_matches_reference(out, grads, views, grad, mask_view, d**-0.5, True)


@pytest.mark.parametrize("S", [3, 5])
def test_second_order_gradcheck_float64(S):
    """create_graph=True through the fused Function: the second-order gradients are those of the
    materialised recompute (gradgradcheck in float64, with a mask and S > T)."""
    inputs = [x.detach().double().requires_grad_() for x in _inputs(B=1, Hq=2, Hkv=1, T=3, S=S, M=2, d=4)]
    mask = torch.ones(1, 1, 3, S, dtype=torch.bool)
    mask[..., 0, 0] = False
    assert torch.autograd.gradgradcheck(lambda *x: moda_torch_flash_cpu(*x, mask, 0.5, True), inputs)


def test_second_order_through_the_public_op_matches_reference():
    """The gradient of a gradient norm (a gradient penalty) through backend="torch" (fused CPU path)."""
    inputs = _inputs(B=1, Hq=4, Hkv=2, T=5, S=7, M=2)

    def penalty_grad(backend):
        out = moda_module.moda_attention(*inputs, backend=backend)
        first = torch.autograd.grad(out.pow(2).sum(), inputs, create_graph=True)
        return torch.autograd.grad(sum(g.pow(2).sum() for g in first), inputs)

    got, want = penalty_grad("torch"), penalty_grad("reference")
    for name, a, b in zip(("q", "k", "v", "depth_k", "depth_v"), got, want):
        err = (a - b).double().norm() / b.double().norm()
        assert err < 1e-4, name  # fp32, fourth-order products of the inputs


def test_once_differentiable_backward_builds_no_graph():
    """Without create_graph the fused backward runs its own formulas (no autograd graph on the gradients)."""
    inputs = _inputs(T=4, S=6, M=2)
    out = moda_torch_flash_cpu(*inputs, None, 0.3, True)
    grads = torch.autograd.grad(out.sum(), inputs)
    assert all(g.grad_fn is None for g in grads)
