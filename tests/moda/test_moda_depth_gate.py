"""The depth gate of ``moda_attention`` (``depth_gate`` [Hq] >= 0 multiplies each head's depth scores): values and
gradients, the gate's included, against the reference on the reference and torch paths, gradcheck above 0, a
one-sided difference at 0 (the gate is not defined below 0), a closed gate is the sequence attention bit for bit,
an open gate of 1 is the ungated op bit for bit, and the gate's validation. The Triton path: tests/kernels."""

import pytest
import torch

from depthfusion_hf.models.moda_attention import moda_attention_weights
from depthfusion_hf.ops import moda_attention

F64 = torch.float64
GATES = {"mixed": [0.0, 0.4, 1.0, 2.5], "closed": [0.0] * 4, "open": [0.3, 0.7, 1.0, 1.9]}


def _inputs(dtype=F64, B=2, Hq=4, Hkv=2, T=5, S=7, M=3, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, Hq, T, d), (B, Hkv, S, d), (B, Hkv, S, d), (B, Hkv, T, M, d), (B, Hkv, T, M, d)]
    return [torch.randn(s, generator=g, dtype=F64).to(dtype).requires_grad_() for s in shapes]


def _masks(T=5, S=7, B=2):
    g = torch.Generator().manual_seed(3)
    return {"none": None, "bool": torch.rand(B, 1, T, S, generator=g) > 0.3,
            "float": torch.randn(B, 1, T, S, generator=g, dtype=F64)}


def _values_and_grads(inputs, gate, mask, backend):
    out = moda_attention(*inputs, attention_mask=mask, backend=backend, depth_gate=gate)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    return [out, *torch.autograd.grad((out * weight).sum(), [*inputs, gate])]


@pytest.mark.parametrize("gate_name", GATES)
@pytest.mark.parametrize("mask_name", ["none", "bool", "float"])
def test_torch_path_matches_the_reference_with_a_gate(gate_name, mask_name):
    """float64: every value and gradient (q, k, v, depth_k, depth_v, gate) to 1e-12, a closed head included."""
    inputs, mask = _inputs(), _masks()[mask_name]
    gate = torch.tensor(GATES[gate_name], dtype=F64, requires_grad=True)
    want = _values_and_grads(inputs, gate, mask, "reference")
    got = _values_and_grads(inputs, gate, mask, "torch")
    for name, g, w in zip(("out", "q", "k", "v", "depth_k", "depth_v", "gate"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)
    assert want[-1].abs().min() > 1e-3  # every head's gate gets a gradient, a closed one too


def test_float32_torch_path_matches_the_float64_reference():
    inputs = _inputs(torch.float32)
    gate = torch.tensor(GATES["mixed"], requires_grad=True)
    got = _values_and_grads(inputs, gate, None, "torch")
    leaves = [x.detach().double().requires_grad_() for x in inputs]
    want = _values_and_grads(leaves, gate.detach().double().requires_grad_(), None, "reference")
    for name, g, w in zip(("out", "q", "k", "v", "depth_k", "depth_v", "gate"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("masked", [False, True], ids=["fused-cpu", "materialised"])
def test_gradcheck_and_gradgradcheck_with_an_open_gate(masked):
    inputs = _inputs(B=1, Hq=2, Hkv=1, T=3, S=3, M=2, d=3)
    gate = torch.tensor([0.3, 1.7], dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, False, False], [True, True, False], [False, False, False]]).view(1, 1, 3, 3)

    def op(*x):
        return moda_attention(*x[:5], depth_gate=x[5], attention_mask=mask if masked else None, backend="torch")

    assert torch.autograd.gradcheck(op, [*inputs, gate])
    assert torch.autograd.gradgradcheck(op, [*inputs, gate])


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_gate_gradient_at_zero_is_the_one_sided_derivative(backend):
    """dL/dg at g = 0 equals the derivative from the right (Richardson-extrapolated one-sided differences, float64:
    the gate is not defined below 0) and the closed form sum_t Z_d / Z_s (o_d - o_s) . dL/do."""
    inputs = [x.detach() for x in _inputs()]
    weight = torch.linspace(-1, 1, inputs[0].numel(), dtype=F64).view(inputs[0].shape)

    def loss(gate):
        return (moda_attention(*inputs, depth_gate=gate, backend=backend) * weight).sum()

    gate = torch.zeros(4, dtype=F64, requires_grad=True)
    (analytic,) = torch.autograd.grad(loss(gate), gate)
    for head in range(4):
        step = torch.zeros(4, dtype=F64)
        step[head] = 1e-6
        one_sided = (4 * loss(step / 2) - loss(step) - 3 * loss(torch.zeros(4, dtype=F64))) / 1e-6  # O(h^2)
        torch.testing.assert_close(analytic[head], one_sided, rtol=1e-6, atol=1e-9)
    # closed form: exp(lse_depth - lse_seq) (o_depth - o_seq) . dL/do, summed over batch and tokens, per head
    q, k, v, depth_k, depth_v = inputs
    o_seq = moda_attention(q, k, v, [], [], backend="reference")
    scale = q.shape[-1] ** -0.5
    seq_logits = torch.einsum("bhtd,bhsd->bhts", q, k.repeat_interleave(2, 1)) * scale
    seq_logits = seq_logits.masked_fill(torch.ones(5, 7, dtype=torch.bool).triu(3), -torch.inf)  # causal: S - T = 2
    depth_logits = torch.einsum("bhtd,bhtmd->bhtm", q, depth_k.repeat_interleave(2, 1)) * scale
    o_depth = torch.einsum("bhtm,bhtmd->bhtd", depth_logits.softmax(-1), depth_v.repeat_interleave(2, 1))
    ratio = (depth_logits.logsumexp(-1) - seq_logits.logsumexp(-1)).exp()  # [B, Hq, T]
    closed_form = (ratio.unsqueeze(-1) * (o_depth - o_seq) * weight).sum(dim=(0, 2, 3))
    torch.testing.assert_close(analytic, closed_form, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("mask_name", ["none", "float"])
def test_a_closed_gate_is_the_sequence_attention(backend, mask_name):
    inputs, mask = _inputs(torch.float32), _masks()[mask_name]
    mask = None if mask is None else mask.float()
    closed = moda_attention(*inputs, attention_mask=mask, backend=backend, depth_gate=torch.zeros(4))
    no_depth = moda_attention(*inputs[:3], [], [], attention_mask=mask, backend=backend)
    if backend == "torch":  # what a converted model runs: exactly its Llama's attention
        assert torch.equal(closed, no_depth)
    else:  # the reference sums S + M scores (M of them 0): another summation order
        torch.testing.assert_close(closed, no_depth, rtol=1e-6, atol=1e-7)
    decoding = [x[:, :, -1:] for x in (inputs[0], *inputs[3:])]  # a one-token step: one SDPA with log g columns
    with torch.no_grad():
        step = moda_attention(decoding[0], *inputs[1:3], *decoding[1:], depth_gate=torch.zeros(4), backend=backend)
        torch.testing.assert_close(step, moda_attention(decoding[0], *inputs[1:3], [], [], backend=backend),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask_name", ["none", "bool", "float"])
def test_a_gate_of_one_is_the_ungated_op_bit_for_bit(mask_name):
    """From-scratch MoDA with learned gates at their initial 1 computes exactly what the paper's (ungated) op does."""
    inputs, mask = _inputs(torch.float32), _masks()[mask_name]
    mask = None if mask is None or mask.dtype == torch.bool else mask.float()
    gate = torch.ones(4, requires_grad=True)
    ungated = moda_attention(*inputs, attention_mask=mask, backend="torch")
    gated = moda_attention(*inputs, attention_mask=mask, backend="torch", depth_gate=gate)
    assert torch.equal(gated, ungated)
    grad = torch.randn_like(ungated)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(gated, inputs, grad),
                                                 torch.autograd.grad(ungated, inputs, grad)))


def test_returned_weights_carry_the_gate():
    inputs = _inputs()
    gate = torch.tensor(GATES["mixed"], dtype=F64, requires_grad=True)
    out, weights = moda_attention(*inputs, backend="torch", depth_gate=gate, return_weights=True)
    torch.testing.assert_close(out, moda_attention(*inputs, backend="reference", depth_gate=gate))
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
    assert weights[:, 0, :, 7:].abs().max() == 0  # head 0 is closed: no depth weight
    direct = moda_attention_weights(inputs[0], inputs[1], list(inputs[3].unbind(3)), None, 6 ** -0.5, True, gate)
    torch.testing.assert_close(direct, weights)


@pytest.mark.parametrize("gate, message", [
    (torch.tensor([0.0, -0.1, 1.0, 1.0]), "finite and >= 0"),
    (torch.tensor([0.0, float("nan"), 1.0, 1.0]), "finite and >= 0"),
    (torch.ones(3), r"\[Hq=4\]"),
    (torch.ones(4, dtype=torch.long), r"\[Hq=4\]"),
    ([1.0] * 4, r"\[Hq=4\]"),
])
def test_a_bad_gate_is_rejected(gate, message):
    with pytest.raises(ValueError, match=message):
        moda_attention(*_inputs(torch.float32), depth_gate=gate)
