"""moda_attention on CPU: the PyTorch path and the reference loop against the float64 reference, values and
gradients (first and second order), the depth entries as a tensor or as a sequence, masks, the scale, degenerate
shapes, the one compute dtype, the returned weights, and the errors the op raises."""


import pytest
import torch
import torch.nn.functional as F

from depthfusion_hf.models.moda_attention import moda_attention_weights
from depthfusion_hf.ops import moda_attention
from tests.moda.op_checks import assert_matches_reference

LAYERS = 6  # "2L" depth entries = 12
F64 = torch.float64


def _inputs(B=2, Hq=4, Hkv=2, T=7, S=None, M=3, d=8, dtype=torch.float32, seed=0):
    S = T + 3 if S is None else S
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, Hq, T, d), (B, Hkv, S, d), (B, Hkv, S, d), (B, Hkv, T, M, d), (B, Hkv, T, M, d)]
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _compare(inputs, attention_mask=None, causal=True, backend="torch", as_entries=False, scale=None):
    """The public op against the float64 reference (tolerances scaled to the dtype, tests/moda/op_checks.py)."""
    grad = torch.randn_like(inputs[0])
    depth = [list(x.unbind(3)) for x in inputs[3:]] if as_entries else inputs[3:]
    out = moda_attention(*inputs[:3], *depth, attention_mask=attention_mask, causal=causal, backend=backend,
                         scale=scale)
    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
    grads = torch.autograd.grad(out, inputs, grad)
    scale = inputs[0].shape[-1] ** -0.5 if scale is None else scale
    assert_matches_reference(out, grads, inputs, grad, attention_mask, scale, causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 7, 63])
@pytest.mark.parametrize("M", [0, 1, 2 * LAYERS])
@pytest.mark.parametrize("extra", [0, 5])  # S = T (prefill: the fused CPU kernel) and S > T (cached decoding)
def test_torch_matches_reference(dtype, T, M, extra):
    _compare(_inputs(T=T, M=M, S=T + extra, dtype=dtype), as_entries=M % 2 == 1)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("M", [0, 1, 2 * LAYERS])
@pytest.mark.parametrize("S", [1, 6])
def test_decoding_step_matches_reference_float64(Hq, Hkv, M, S):
    """The one-token step without gradient (the torch path's SDPA over [sequence | entries]) against the reference,
    in float64, the entries as a model writes them: separate tensors, the values strided (every other row)."""
    q, k, v, dk, dv = (x.detach().to(F64) for x in _inputs(B=2, Hq=Hq, Hkv=Hkv, T=1, S=S, M=M, d=8))
    keys, values = list(dk.unbind(3)), [x.repeat_interleave(2, dim=-1)[..., ::2] for x in dv.unbind(3)]
    want = moda_attention(q, k, v, dk, dv, backend="reference")
    with torch.no_grad():
        got = moda_attention(q, k, v, keys, values, backend="torch")
    assert got.dtype == F64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("Hq,Hkv", [(3, 3), (6, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_gqa_and_non_causal(Hq, Hkv, causal):
    _compare(_inputs(Hq=Hq, Hkv=Hkv, T=5, S=5, M=2), causal=causal)


def test_entries_as_a_sequence_equal_the_stacked_tensor():
    """A model passes the entries as it wrote them (a sequence of [B, Hkv, T, d]); same values and gradients."""
    inputs = _inputs(M=4, dtype=F64)
    grad = torch.randn_like(inputs[0])
    stacked = moda_attention(*inputs, backend="torch")
    listed = moda_attention(*inputs[:3], list(inputs[3].unbind(3)), list(inputs[4].unbind(3)), backend="torch")
    assert torch.equal(stacked, listed)
    for a, b in zip(torch.autograd.grad(stacked, inputs, grad), torch.autograd.grad(listed, inputs, grad)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["bool", "additive", "per_head", "additive_grad"])
def test_masks_apply_to_the_sequence_pool_only(kind):
    inputs = _inputs(B=2, Hq=4, Hkv=2, T=6, S=9, M=4)
    keep = torch.rand(2, 1, 6, 9) > 0.4
    keep[0, 0, 2] = False  # one fully masked sequence row: the depth entries still get the mass
    if kind == "bool":
        mask = keep
    elif kind == "per_head":
        mask = torch.randn(1, 4, 6, 9)
    else:
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) + 0.1 * torch.randn(keep.shape)
        mask.requires_grad_(kind == "additive_grad")
    _compare(inputs, attention_mask=mask)
    out, weights = moda_attention(*inputs, attention_mask=mask, return_weights=True)  # (B, Hq, T, S + M)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 6))
    if kind == "bool":
        assert weights[0, :, 2, :9].abs().max() == 0
        torch.testing.assert_close(weights[0, :, 2, 9:].sum(-1), torch.ones(4))
    if kind == "additive_grad":  # the mask's gradient, against the reference backend's autograd
        (got,) = torch.autograd.grad(moda_attention(*inputs, attention_mask=mask).sum(), [mask])
        (want,) = torch.autograd.grad(moda_attention(*inputs, attention_mask=mask, backend="reference").sum(), [mask])
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


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
        out, got_weights = moda_attention(q, k, v, dk, dv, scale=1.0, backend=backend, return_weights=True)
        torch.testing.assert_close(out.view(2), expected)
        torch.testing.assert_close(got_weights.view(3), weights)


def test_row_with_no_entry_returns_zeros():
    q, k, v, dk, dv = _inputs(B=1, Hq=2, Hkv=1, T=3, S=3, M=0)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = False
    for backend in ("reference", "torch"):
        out = moda_attention(q, k, v, dk, dv, attention_mask=mask, backend=backend)
        assert torch.isfinite(out).all()
        assert out[:, :, 1].abs().max() == 0
        assert out[:, :, 0].abs().max() > 0
        grads = torch.autograd.grad(out.sum(), [q, k, v])
        assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("masked", [False, True], ids=["fused-cpu", "materialised"])
def test_gradcheck_and_gradgradcheck_float64(masked):
    """First and second order (create_graph=True) through the PyTorch path: without a mask the fused CPU kernel
    runs the forward, with one the materialised pool; a fully masked row included."""
    inputs = [x.detach().to(F64).requires_grad_() for x in _inputs(B=1, Hq=2, Hkv=1, T=3, S=3, M=2, d=3)]
    mask = None
    if masked:
        mask = torch.tensor([[True, False, False], [True, True, False], [False, False, False]]).view(1, 1, 3, 3)

    def op(*x):
        return moda_attention(*x, attention_mask=mask, backend="torch")

    assert torch.autograd.gradcheck(op, inputs)
    assert torch.autograd.gradgradcheck(op, inputs)


@pytest.mark.parametrize("scale", [0.0, -0.7, 3.0])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("M", [0, 3])
def test_any_finite_scale_matches_the_reference(scale, masked, M):
    """A zero, negative or large scale is computed (the torch backend gave NaN for 0 and negative scales: the
    fused CPU kernel masks the causal keys before it scales)."""
    inputs = _inputs(B=1, Hq=2, Hkv=1, T=3, S=3, M=M, d=4)
    mask = torch.rand(1, 1, 3, 3, generator=torch.Generator().manual_seed(1)) > 0.3 if masked else None
    _compare(inputs, attention_mask=mask, scale=scale)


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan"), True, "0.5"])
def test_scale_that_is_not_a_finite_number_is_rejected(scale):
    with pytest.raises(ValueError, match="scale must be a finite real number"):
        moda_attention(*[x.detach() for x in _inputs()], scale=scale)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("kind", ["bool", "additive", "causal"])
def test_a_nan_in_a_hidden_key_contributes_nothing(backend, kind):
    """A NaN key hidden by the mask (False or -inf) or by causality leaves every output it is hidden from exact."""
    q, k, v, dk, dv = (x.detach().to(F64) for x in _inputs(B=2, T=5, S=5, M=2))
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    poisoned = k.clone()
    if kind == "causal":
        poisoned[:, :, 4] = float("nan")  # visible to the last query only
        mask, hidden_from = None, slice(0, 4)
    else:
        keep[0, ..., 1] = False  # padding of batch row 0, key 1
        poisoned[0, :, 1] = float("nan")
        mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=F64).masked_fill(~keep, float("-inf"))
        hidden_from = slice(0, 5)
    want = moda_attention(q, k, v, dk, dv, attention_mask=mask, backend="reference")
    got = moda_attention(q, poisoned, v, dk, dv, attention_mask=mask, backend=backend)
    rows = slice(0, 2) if kind == "causal" else slice(0, 1)
    torch.testing.assert_close(got[rows, :, hidden_from], want[rows, :, hidden_from], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("shape", [(0, 4, 5), (2, 4, 0)], ids=["B=0", "T=0"])
def test_no_queries_give_an_empty_output_with_zero_gradients(backend, shape):
    B, Hq, T = shape
    q = torch.randn(B, Hq, T, 8, requires_grad=True)
    k, v = (torch.randn(B, 2, 6, 8, requires_grad=True) for _ in range(2))
    dk, dv = (torch.randn(B, 2, T, 3, 8, requires_grad=True) for _ in range(2))
    out = moda_attention(q, k, v, dk, dv, backend=backend)
    assert out.shape == q.shape
    grads = torch.autograd.grad(out.sum(), [q, k, v, dk, dv])
    assert all(g.shape == x.shape and not g.any() for g, x in zip(grads, [q, k, v, dk, dv]))


def test_head_dim_zero_is_rejected():
    q, k, v = torch.randn(1, 2, 3, 0), torch.randn(1, 2, 3, 0), torch.randn(1, 2, 3, 0)
    with pytest.raises(ValueError, match="head dim d >= 1"):
        moda_attention(q, k, v, torch.randn(1, 2, 3, 1, 0), torch.randn(1, 2, 3, 1, 0))


def test_weights_carry_gradients():
    """``return_weights`` gives the joint softmax with autograd (the model's ``output_attentions``), the same on
    both CPU backends; its gradients are right (gradcheck)."""
    q, k, v, dk, dv = (x.detach().to(F64).requires_grad_() for x in _inputs(B=1, Hq=2, Hkv=1, T=3, S=4, M=2, d=3))
    mask = torch.tensor([True, False, True, True]).view(1, 1, 1, 4)
    weights = [moda_attention(q, k, v, dk, dv, attention_mask=mask, backend=backend, return_weights=True)[1]
               for backend in ("torch", "reference")]
    assert all(w.requires_grad and w.shape == (1, 2, 3, 6) for w in weights)
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)
    assert torch.autograd.gradcheck(
        lambda q, k, dk: moda_attention_weights(q, k, list(dk.unbind(3)), mask, 0.3, True), [q, k, dk])


def test_one_compute_dtype_under_autocast_and_promotion():
    """Under autocast the autocast dtype for every input (RoPE leaves q, k in fp32 while v is bf16); otherwise
    the promoted dtype; float64 stays float64."""
    q, k, v, dk, dv = (x.detach() for x in _inputs(M=2))
    bf16 = [x.bfloat16() for x in (q, k, v, dk, dv)]
    want = moda_attention(*bf16, backend="torch")
    for backend in ("torch", "reference"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = moda_attention(q, k, bf16[2], dk, bf16[4], backend=backend)
        assert got.dtype == torch.bfloat16
        if backend == "torch":
            assert torch.equal(got, want)
    assert moda_attention(q, k, v.double(), dk, dv).dtype == F64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert moda_attention(*(x.double() for x in (q, k, v, dk, dv))).dtype == F64


def test_inference_mode():
    inputs = [x.detach() for x in _inputs(M=3)]
    with torch.inference_mode():
        out = moda_attention(*inputs)
    torch.testing.assert_close(out, moda_attention(*inputs, backend="reference"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "index,shape,name",
    [
        (0, (2, 4, 7), "q"),
        (1, (2, 3, 10, 8), "k"),  # Hq=4 not a multiple of 3
        (1, (2, 2, 5, 8), "k"),  # S < T
        (2, (2, 2, 9, 8), "v"),
        (3, (2, 2, 7, 3, 4), "depth_k"),
        (3, (2, 2, 6, 3, 8), "depth_k"),
        (3, (2, 2, 7, 8), "depth_k"),
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
    with pytest.raises(ValueError, match="attention_mask must be bool .* on q's device"):
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


@pytest.mark.parametrize("with_depth", [False, True], ids=["no-depth", "closed-gate"])
def test_a_row_of_only_finfo_min_keys_is_their_mean(with_depth):
    """Issue 27: a padding row of an eager mask (every key at finfo.min, no depth weight) is the mean of its keys'
    values on every backend, as in the reference and transformers' eager attention (the torch path returned their
    sum: the log-sum-exp rounds log(n) away at -3.4e38), with the reference's gradients."""
    q, k, v, dk, dv = _inputs(B=1, Hq=2, Hkv=1, T=3, S=3, M=2 if with_depth else 0)
    low = torch.finfo(torch.float32).min
    mask = torch.zeros(1, 1, 3, 3).masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), low)
    mask[..., 1, :] = low  # row 1 sees keys 0 and 1, both at finfo.min
    gate = torch.zeros(2) if with_depth else None
    grad = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(5))
    results = {}
    for backend in ("reference", "torch"):
        out = moda_attention(q, k, v, dk, dv, attention_mask=mask, backend=backend, depth_gate=gate)
        results[backend] = [out, *torch.autograd.grad(out, [q, k, v], grad)]
    want_row = v[0, 0, :2].mean(dim=0).detach()
    torch.testing.assert_close(results["torch"][0][0, :, 1], want_row.expand(2, -1))
    for got, want in zip(results["torch"], results["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # transformers' eager attention in float32 over the keys the row sees (its own mask also carries causality, so
    # on a padding row it averages the future keys too: padding rows are not compared with a Llama's)
    logits = torch.einsum("hd,sd->hs", q[0, :, 1], k[0, 0, :2]) * 8 ** -0.5 + mask[0, 0, 1, :2]
    torch.testing.assert_close(results["torch"][0][0, :, 1], torch.softmax(logits, dim=-1) @ v[0, 0, :2])
