"""moda_attention: the vectorised PyTorch path against the reference loop, values and gradients."""

import os

import pytest
import torch
import torch.nn.functional as F

from depthfusion_hf.models.moda.moda_attention import moda_joint_probs, resolve_backend
from depthfusion_hf.ops import moda_attention
from tests.moda.op_checks import assert_matches_reference

LAYERS = 6  # "2L" depth entries = 12


def _inputs(B=2, Hq=4, Hkv=2, T=7, S=None, M=3, d=8, dtype=torch.float32):
    S = T + 3 if S is None else S
    shapes = [(B, Hq, T, d), (B, Hkv, S, d), (B, Hkv, S, d), (B, Hkv, T, M, d), (B, Hkv, T, M, d)]
    return [torch.randn(s, dtype=dtype).requires_grad_() for s in shapes]


def _compare(inputs, attention_mask=None, causal=True):
    """backend="torch" through the public op against the float64 reference, with tolerances scaled to
    the dtype and the inputs (tests/moda/op_checks.py)."""
    grad = torch.randn_like(inputs[0])
    out = moda_attention(*inputs, attention_mask=attention_mask, causal=causal, backend="torch")
    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
    grads = torch.autograd.grad(out, inputs, grad)
    assert_matches_reference(out, grads, inputs, grad, attention_mask, inputs[0].shape[-1] ** -0.5, causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 7, 63])
@pytest.mark.parametrize("M", [0, 1, 2 * LAYERS])
def test_torch_matches_reference(dtype, T, M):
    _compare(_inputs(T=T, M=M, S=T + 5, dtype=dtype))


@pytest.mark.parametrize("Hq,Hkv", [(3, 3), (6, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_gqa_and_non_causal(Hq, Hkv, causal):
    _compare(_inputs(Hq=Hq, Hkv=Hkv, T=5, S=5, M=2), causal=causal)


@pytest.mark.parametrize("kind", ["bool", "additive", "per_head"])
def test_masks_apply_to_the_sequence_pool_only(kind):
    inputs = _inputs(B=2, Hq=4, Hkv=2, T=6, S=9, M=4)
    keep = torch.rand(2, 1, 6, 9) > 0.4
    keep[0, 0, 2] = False  # one fully masked sequence row: the depth entries still get the mass
    if kind == "bool":
        mask = keep
    elif kind == "additive":
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) + 0.1 * torch.randn(keep.shape)
    else:
        mask = torch.randn(1, 4, 6, 9)
    _compare(inputs, attention_mask=mask)
    probs = moda_joint_probs(inputs[0], inputs[1], inputs[3], mask, 8**-0.5, True)  # (B, Hkv, G, T, S + M)
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)))
    if kind == "bool":
        assert probs[0, :, :, 2, :9].abs().max() == 0
        torch.testing.assert_close(probs[0, :, :, 2, 9:].sum(-1), torch.ones(2, 2))


def test_reference_without_depth_is_standard_attention():
    q, k, v, dk, dv = _inputs(Hq=4, Hkv=2, T=5, S=8, M=0)
    causal = torch.ones(5, 8, dtype=torch.bool).tril(8 - 5)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=causal)
    for backend in ("reference", "torch"):
        torch.testing.assert_close(moda_attention(q, k, v, dk, dv, backend=backend), expected)


def test_joint_softmax_by_hand():
    # one head, one query, two sequence keys and one depth key, all logits known.
    q = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    k = torch.tensor([[0.0, 0.0], [2.0, 0.0]]).view(1, 1, 2, 2)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    dk = torch.tensor([[1.0, 5.0]]).view(1, 1, 1, 1, 2)
    dv = torch.tensor([[3.0, 3.0]]).view(1, 1, 1, 1, 2)
    weights = torch.softmax(torch.tensor([0.0, 2.0, 1.0]), 0)  # scale 1
    expected = weights[0] * v[0, 0, 0] + weights[1] * v[0, 0, 1] + weights[2] * dv[0, 0, 0, 0]
    for backend in ("reference", "torch"):
        out = moda_attention(q, k, v, dk, dv, scale=1.0, backend=backend)
        torch.testing.assert_close(out.view(2), expected)


def test_row_with_no_entry_returns_zeros():
    q, k, v, dk, dv = _inputs(B=1, Hq=2, Hkv=1, T=3, S=3, M=0)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = False
    for backend in ("reference", "torch"):
        out = moda_attention(q, k, v, dk, dv, attention_mask=mask, backend=backend)
        assert torch.isfinite(out).all()
        assert out[:, :, 1].abs().max() == 0
        assert out[:, :, 0].abs().max() > 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_gradcheck_float64():
    inputs = [x.detach().double().requires_grad_() for x in _inputs(B=1, Hq=2, Hkv=1, T=3, S=4, M=2, d=4)]
    mask = torch.tensor([True, False, True, True]).view(1, 1, 1, 4)
    assert torch.autograd.gradcheck(lambda *x: moda_attention(*x, attention_mask=mask, backend="torch"), inputs)


@pytest.mark.parametrize(
    "index,shape,name",
    [
        (0, (2, 4, 7), "q"),
        (1, (2, 3, 10, 8), "k"),  # Hq=4 not a multiple of 3
        (1, (2, 2, 5, 8), "k"),  # S < T
        (2, (2, 2, 9, 8), "v"),
        (3, (2, 2, 7, 3, 4), "depth_k"),
        (3, (2, 2, 6, 3, 8), "depth_k"),
        (4, (2, 2, 7, 2, 8), "depth_v"),
    ],
)
def test_bad_shapes_raise(index, shape, name):
    inputs = [x.detach() for x in _inputs(T=7, S=10, M=3, d=8)]
    inputs[index] = torch.randn(shape)
    with pytest.raises(ValueError, match=rf"^{name} must"):
        moda_attention(*inputs)


def test_bad_mask_raises():
    inputs = [x.detach() for x in _inputs(T=7, S=10, M=3)]
    with pytest.raises(ValueError, match="attention_mask must be broadcastable"):
        moda_attention(*inputs, attention_mask=torch.ones(2, 10, dtype=torch.bool))
    for dtype in (torch.long, torch.uint8, torch.complex64, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="attention_mask must be bool"):
            moda_attention(*inputs, attention_mask=torch.ones(2, 1, 7, 10).to(dtype))
    with pytest.raises(ValueError, match="attention_mask must be on q's device"):
        moda_attention(*inputs, attention_mask=torch.ones(2, 1, 7, 10, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64,
                                   torch.float8_e4m3fn])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_non_float_dtypes_raise(dtype, backend):
    """Integer, bool, complex and float8 inputs are rejected (the paths returned zeros, truncated or
    dropped imaginary parts)."""
    inputs = [torch.randint(-3, 3, x.shape).to(dtype) for x in _inputs(T=3, S=4, M=1)]
    with pytest.raises(ValueError, match="q must have a floating dtype"):
        moda_attention(*inputs, backend=backend)


def test_backend_dispatch(monkeypatch):
    monkeypatch.delenv("DEPTHFUSION_BACKEND", raising=False)
    assert resolve_backend(None, torch.device("cpu")) == "torch"
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
    assert resolve_backend(None, torch.device("cpu")) == "reference"
    assert resolve_backend("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        moda_attention(*[x.detach() for x in _inputs()], backend="cuda-magic")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="backend='triton' was requested but Triton"):
            moda_attention(*[x.detach() for x in _inputs()], backend="triton")
