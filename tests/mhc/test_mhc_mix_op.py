"""hyper_mix: the reference is transformers' DeepseekV4DecoderLayer mixing step, the torch backend equals the
reference (values and every gradient, every order), dtypes, autocast and bad inputs."""

import pytest
import torch

from depthfusion_hf.models.mhc_mix import hyper_mix, hyper_mix_reference, hyper_mix_torch

from .helpers import EPS, max_rel, mix_inputs

EPS64, EPS32 = EPS[torch.float64], EPS[torch.float32]
SHAPES = [(2, 3, 1, 5), (1, 4, 2, 7), (2, 1, 3, 12), (2, 3, 4, 16), (1, 5, 5, 9), (3, 2, 4, 1)]
IDS = [f"B{b}T{t}n{n}D{d}" for b, t, n, d in SHAPES]


def transformers_mix(streams, output, post, comb):
    """``DeepseekV4DecoderLayer``'s step: ``post.unsqueeze(-1) * out.unsqueeze(-2) + comb^T @ streams``."""
    return post.unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)


def grads(output, inputs, seed=1):
    weight = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed)).to(output.dtype)
    return torch.autograd.grad(output, inputs, weight)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_reference_and_torch_backend_are_transformers_formula_in_float64(shape):
    inputs = mix_inputs(*shape)
    want = transformers_mix(*inputs)
    want_grads = grads(want, inputs)
    for backend in ("reference", "torch"):
        got = hyper_mix(*inputs, backend=backend)
        assert got.dtype == torch.float64 and got.shape == want.shape
        assert max_rel(got, want) <= 16 * EPS64, backend
        for name, g, w in zip(("streams", "output", "post", "comb"), grads(got, inputs), want_grads):
            assert max_rel(g, w) <= 16 * EPS64, (backend, name)
        with torch.no_grad():  # the torch path without autograd
            assert max_rel(hyper_mix(*inputs, backend=backend), want) <= 16 * EPS64, backend


def test_comb_is_applied_transposed():
    """comb[j, k] weighs stream j in the new stream k: a comb that moves stream 0 to stream 1 (and post = 0)."""
    streams = torch.arange(2 * 4, dtype=torch.float64).view(1, 1, 2, 4)
    comb = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64).view(1, 1, 2, 2)
    comb[..., 1, 1] = 0.5
    for backend in ("reference", "torch"):
        new = hyper_mix(streams, torch.ones(1, 1, 4, dtype=torch.float64), torch.zeros(1, 1, 2, dtype=torch.float64),
                        comb, backend=backend)
        assert torch.equal(new[0, 0, 1], streams[0, 0, 0] + 0.5 * streams[0, 0, 1])
        assert torch.equal(new[0, 0, 0], streams[0, 0, 1])


@pytest.mark.parametrize("n", [1, 3])
def test_torch_backend_gradcheck_and_gradgradcheck(n):
    inputs = mix_inputs(1, 2, n, 3, seed=n)
    assert torch.autograd.gradcheck(lambda *a: hyper_mix_torch(*a, torch.float64), inputs)
    assert torch.autograd.gradgradcheck(lambda *a: hyper_mix_torch(*a, torch.float64), inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_lower_precision_is_accumulated_in_fp32_and_rounded_once(dtype):
    """Streams and output in ``dtype``, fp32 weights (the model's case): every element is the float64 truth of the
    same inputs rounded once (plus fp32 arithmetic error), and so is the streams' and the output's gradient."""
    streams, output, post, comb = mix_inputs(2, 5, 4, 24, torch.float32, seed=2)
    streams, output = (t.detach().to(dtype).requires_grad_() for t in (streams, output))
    got = hyper_mix(streams, output, post, comb, backend="torch")
    assert got.dtype == dtype
    truth_inputs = [t.detach().double().requires_grad_() for t in (streams, output, post, comb)]
    want = hyper_mix_reference(*truth_inputs, torch.float64)
    unit = EPS[dtype]

    def rounded_once(g, w):
        err = (g.double() - w.detach()).abs()
        return bool((err <= unit * w.detach().abs() + 64 * EPS32 * w.detach().abs().max()).all())

    assert rounded_once(got, want)
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    got_grads = torch.autograd.grad(got, (streams, output, post, comb), weight)
    want_grads = torch.autograd.grad(want, truth_inputs, weight.double())
    assert [g.dtype for g in got_grads] == [dtype, dtype, torch.float32, torch.float32]
    assert rounded_once(got_grads[0], want_grads[0]) and rounded_once(got_grads[1], want_grads[1])
    for g, w in zip(got_grads[2:], want_grads[2:]):
        assert max_rel(g, w) <= 64 * EPS32  # sums over D = 24 products in fp32


def test_result_dtype_is_promoted_from_streams_and_output_and_autocast_leaves_it():
    """fp32 streams and a bf16 sub-layer output (an fp32 model under bf16 autocast): the new streams are fp32, as
    a Llama's residual ``x + f(x)`` is, and autocast does not change the numbers."""
    streams, output, post, comb = mix_inputs(1, 3, 4, 8, torch.float32, requires_grad=False)
    output = output.to(torch.bfloat16)
    for backend in ("reference", "torch"):
        want = hyper_mix(streams, output, post, comb, backend=backend)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = hyper_mix(streams, output, post, comb, backend=backend)
        assert want.dtype == got.dtype == torch.float32 and torch.equal(got, want)
        assert hyper_mix(streams.to(torch.bfloat16), output, post, comb, backend=backend).dtype == torch.bfloat16


def test_expanded_streams_and_inference_mode():
    _, output, post, comb = mix_inputs(2, 3, 4, 6, requires_grad=False)
    embedding = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    expanded = embedding.unsqueeze(2).expand(-1, -1, 4, -1)
    want = hyper_mix(expanded.detach().contiguous(), output, post, comb, backend="reference")
    got = hyper_mix(expanded, output, post, comb, backend="torch")
    assert max_rel(got, want) <= 16 * EPS64
    (grad,) = torch.autograd.grad(got.sum(), embedding)
    assert torch.allclose(grad, comb.sum(-1).sum(-1, keepdim=True).expand(-1, -1, 6), rtol=1e-14, atol=0)
    with torch.inference_mode():
        assert torch.equal(hyper_mix(expanded.detach(), output, post, comb, backend="torch"), got.detach())


BAD = [
    (dict(streams=torch.zeros(2, 3, 4)), r"streams must have shape \[B, T, n, D\]"),
    (dict(output=torch.zeros(1, 2, 4)), r"output must have shape \[B, T, D\] = \(1, 2, 3\)"),
    (dict(post=torch.zeros(1, 2, 3)), r"post must have shape \[B, T, n\] = \(1, 2, 2\)"),
    (dict(comb=torch.zeros(1, 2, 2)), r"comb must have shape \[B, T, n, n\] = \(1, 2, 2, 2\)"),
    (dict(comb=torch.zeros(1, 2, 2, 2, dtype=torch.int64)), "comb must have a floating-point dtype"),
    (dict(output=torch.zeros(1, 2, 3, device="meta")), "output must be on the streams' device"),
    (dict(backend="fast"), "backend must be one of"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m[:24] for _, m in BAD])
def test_bad_inputs_are_rejected_naming_the_problem(change, message):
    args = dict(streams=torch.zeros(1, 2, 2, 3), output=torch.zeros(1, 2, 3), post=torch.zeros(1, 2, 2),
                comb=torch.zeros(1, 2, 2, 2), backend=None) | change
    with pytest.raises(ValueError, match=message):
        hyper_mix(args.pop("streams"), args.pop("output"), args.pop("post"), args.pop("comb"), **args)
