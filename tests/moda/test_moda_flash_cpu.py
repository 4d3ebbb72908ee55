"""moda_attention's fused CPU path (SDPA flash kernel + depth pool, merged by log-sum-exp) and the
materialised PyTorch path, each against the reference loop: values and gradients."""

from __future__ import annotations

import importlib

import pytest
import torch

from depthfusion_hf.models.moda.moda_attention import moda_reference, moda_torch_flash_cpu, moda_torch_math

moda_module = importlib.import_module("depthfusion_hf.models.moda.moda_attention")
PATHS = {"flash_cpu": moda_torch_flash_cpu, "math": moda_torch_math}


def _relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).pow(2).mean().sqrt() / (b.double().pow(2).mean().sqrt() + 1e-12)).item()


def _inputs(B=2, Hq=4, Hkv=2, T=7, S=None, M=3, d=8, dtype=torch.float32, seed=0):
    """q [B, Hq, T, d] (stored [B, T, Hq, d] as in the model), k, v [B, Hkv, S, d], depth [B, Hkv, T, M, d]."""
    gen = torch.Generator().manual_seed(seed)
    S = T + 3 if S is None else S
    q = torch.randn(B, T, Hq, d, generator=gen).transpose(1, 2).to(dtype).requires_grad_()
    rest = [(B, Hkv, S, d), (B, Hkv, S, d), (B, Hkv, T, M, d), (B, Hkv, T, M, d)]
    return [q] + [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in rest]


def _compare(path, inputs, tol, mask=None, causal=True, scale=None):
    """``path`` against the reference (computed in float32 on the same values): output and all five gradients."""
    scale = inputs[0].shape[-1] ** -0.5 if scale is None else scale
    grad = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(inputs[0].dtype)
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    ref = moda_reference(*ref_inputs, mask, scale, causal)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad.float())
    out = PATHS[path](*inputs, mask, scale, causal)
    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
    grads = torch.autograd.grad(out, inputs, grad)
    assert torch.isfinite(out).all()
    assert _relative_rms(out, ref) < tol
    for name, g, r in zip(("q", "k", "v", "depth_k", "depth_v"), grads, ref_grads):
        assert g.shape == r.shape and g.dtype == inputs[0].dtype, name
        assert torch.isfinite(g).all(), name
        if r.numel() and r.abs().max() > 0:
            assert _relative_rms(g, r) < 4 * tol, name
        else:
            assert g.numel() == 0 or g.abs().max() == 0, name


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("T", [1, 7, 63])
@pytest.mark.parametrize("M", [0, 1, 12])
@pytest.mark.parametrize("extra", [0, 5])  # S = T (prefill) and S > T (cached decoding)
def test_matches_reference(path, dtype, tol, T, M, extra):
    _compare(path, _inputs(T=T, S=T + extra, M=M, dtype=dtype), tol)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("Hq,Hkv", [(3, 3), (6, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S", [5, 9])
def test_gqa_non_causal_and_long_cache(path, Hq, Hkv, causal, S):
    _compare(path, _inputs(Hq=Hq, Hkv=Hkv, T=5, S=S, M=2, d=12), 1e-5, causal=causal)


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
    _compare(path, inputs, 1e-5, mask=mask)


def test_scale_and_large_logits():
    inputs = [(x * 4).detach().requires_grad_() for x in _inputs(T=9, S=12, M=5)]
    _compare("flash_cpu", inputs, 1e-5, scale=0.7)


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
