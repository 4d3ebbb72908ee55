"""The fused Triton kernels of hyper_connection, hyper_head and hyper_mix against the float64 reference: values and
every gradient, fp32 / bf16 / fp16 streams, awkward n and D, one token, several programs and masked tails; the
routing of what they cannot compute; an mHC model on them.

Runs in-process on CUDA, or on CPU when ``TRITON_INTERPRET=1`` was set before the kernels were imported (a plain
CPU run executes this module in an interpreted child: ``test_mhc_triton_interpreted.py``).
"""

import pytest
import torch

from depthfusion_hf.models import depthfusion_common, mhc_connection, mhc_mix, mhc_triton
from depthfusion_hf.models.mhc_connection import hyper_connection, hyper_connection_reference, hyper_head
from depthfusion_hf.models.mhc_mix import hyper_mix, hyper_mix_reference
from depthfusion_hf.models.modeling_mhc import MHCForCausalLM
from tests.mhc.helpers import EPS, max_rel, mix_inputs, op_inputs, randomise_mhc, tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS32 = EPS[torch.float32]
NORM_EPS = 1e-6
# (B, T, n, D, iters): n = 1..5, D not a power of two (and D > 64: several D chunks), one token, several token blocks
SHAPES = [(1, 1, 4, 16, 20), (2, 9, 3, 20, 3), (1, 5, 1, 7, 2), (2, 3, 5, 9, 4), (1, 20, 2, 70, 1), (3, 7, 4, 33, 2)]
IDS = [f"B{b}T{t}n{n}D{d}it{i}" for b, t, n, d, i in SHAPES]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def to_device(tensors, dtype=None):
    """Leaf copies on DEVICE; the first (the streams) in ``dtype`` when given, the rest in float32."""
    out = []
    for i, t in enumerate(tensors):
        value = t.detach().to(DEVICE, dtype if (i == 0 and dtype is not None) else torch.float32)
        out.append(value.requires_grad_())
    return out


def rounded_once(got, want, dtype, slack=64):
    """Each element is the truth rounded once to ``dtype``: within one ulp (the interpreter's cast truncates,
    CUDA's rounds to nearest), or the subnormal spacing, plus the fp32 arithmetic error (``slack`` eps32 of the
    scale)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    info = torch.finfo(dtype)
    bound = info.eps * want.abs() + info.smallest_normal * info.eps + slack * EPS32 * want.abs().max()
    return bool(((got - want).abs() <= bound).all())


def output_weights(outputs, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=generator).to(o.dtype).to(o.device) for o in outputs]


def test_triton_is_available_and_auto_dispatch():
    assert depthfusion_common.triton_available()
    assert mhc_connection.triton_hyper_connection is mhc_triton.triton_hyper_connection
    assert mhc_mix.triton_hyper_mix is mhc_triton.triton_hyper_mix
    assert mhc_connection.resolve_backend(None, torch.device(DEVICE)) == ("triton" if DEVICE == "cuda" else "torch")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_hyper_connection_matches_the_float64_truth(shape, dtype):
    batch, tokens, n, dim, iters = shape
    inputs = to_device(op_inputs(batch, tokens, n, dim, torch.float32, seed=n + dim), dtype)
    truth = [t.detach().double().cpu().requires_grad_() for t in inputs]
    got = hyper_connection(*inputs, sinkhorn_iters=iters, eps=1e-6, norm_eps=NORM_EPS, backend="triton")
    want = hyper_connection_reference(*truth, iters, 1e-6, NORM_EPS)
    assert [t.dtype for t in got] == [torch.float32, torch.float32, dtype]
    assert max_rel(got[0].cpu(), want[0]) <= 64 * EPS32 and max_rel(got[1].cpu(), want[1]) <= 64 * EPS32
    assert rounded_once(got[2], want[2], dtype)
    weights = output_weights(got)
    got_grads = torch.autograd.grad(got, inputs, weights)
    want_grads = torch.autograd.grad(want, truth, [w.double().cpu() for w in weights])
    assert got_grads[0].dtype == dtype and rounded_once(got_grads[0], want_grads[0], dtype, slack=256)
    for name, g, w in zip(("fn", "base", "scale"), got_grads[1:], want_grads[1:]):
        # fp32 sums over the B T tokens (and the n D inputs for fn): relative to the scale of the gradient
        assert max_rel(g.cpu(), w) <= 1024 * EPS32, name


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES[1:4], ids=IDS[1:4])
def test_hyper_head_matches_the_float64_truth(shape, dtype):
    batch, tokens, n, dim, _ = shape
    inputs = to_device(op_inputs(batch, tokens, n, dim, torch.float32, head=True, seed=n), dtype)
    truth = [t.detach().double().cpu().requires_grad_() for t in inputs]
    got = hyper_head(*inputs, eps=1e-6, norm_eps=NORM_EPS, backend="triton")
    want = hyper_head(*truth, eps=1e-6, norm_eps=NORM_EPS, backend="reference")
    assert got.dtype == dtype and rounded_once(got, want, dtype)
    (weight,) = output_weights([got])
    got_grads = torch.autograd.grad(got, inputs, weight)
    want_grads = torch.autograd.grad(want, truth, weight.double().cpu())
    assert rounded_once(got_grads[0], want_grads[0], dtype, slack=256)
    for g, w in zip(got_grads[1:], want_grads[1:]):
        assert max_rel(g.cpu(), w) <= 1024 * EPS32


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_hyper_mix_matches_the_float64_truth(shape, dtype):
    batch, tokens, n, dim, _ = shape
    streams, output, post, comb = mix_inputs(batch, tokens, n, dim, torch.float32, seed=dim)
    inputs = [streams.detach().to(DEVICE, dtype).requires_grad_(), output.detach().to(DEVICE, dtype).requires_grad_(),
              post.detach().to(DEVICE).requires_grad_(), comb.detach().to(DEVICE).requires_grad_()]
    truth = [t.detach().double().cpu().requires_grad_() for t in inputs]
    got = hyper_mix(*inputs, backend="triton")
    want = hyper_mix_reference(*truth, torch.float64)
    assert got.dtype == dtype and rounded_once(got, want, dtype)
    (weight,) = output_weights([got])
    got_grads = torch.autograd.grad(got, inputs, weight)
    want_grads = torch.autograd.grad(want, truth, weight.double().cpu())
    assert [g.dtype for g in got_grads] == [dtype, dtype, torch.float32, torch.float32]
    assert rounded_once(got_grads[0], want_grads[0], dtype) and rounded_once(got_grads[1], want_grads[1], dtype)
    for g, w in zip(got_grads[2:], want_grads[2:]):
        assert max_rel(g.cpu(), w) <= 64 * EPS32


def test_mixed_dtypes_fp32_streams_and_bf16_output():
    """Under autocast an fp32 model adds a bf16 sub-layer output to fp32 streams: fp32 result, read as given."""
    streams, output, post, comb = [t.to(DEVICE) for t in mix_inputs(2, 3, 4, 40, torch.float32, requires_grad=False)]
    output = output.to(torch.bfloat16)
    got = hyper_mix(streams, output, post, comb, backend="triton")
    want = hyper_mix(streams, output, post, comb, backend="torch")
    assert got.dtype == torch.float32 and max_rel(got.cpu(), want.cpu()) <= 16 * EPS32


def test_routing_float64_and_many_streams_to_torch(monkeypatch):
    """float64 work and n > TRITON_MAX_STREAMS leave the kernels for the torch backend (same numbers)."""
    calls = []
    monkeypatch.setattr(mhc_connection, "triton_hyper_connection", lambda *a, **k: calls.append("triton"))
    streams, fn, base, scale = [t.to(DEVICE) for t in op_inputs(1, 2, 3, 4, torch.float64)]
    got = hyper_connection(streams, fn, base, scale, sinkhorn_iters=3, eps=1e-6, norm_eps=NORM_EPS, backend="triton")
    want = hyper_connection(streams, fn, base, scale, sinkhorn_iters=3, eps=1e-6, norm_eps=NORM_EPS, backend="torch")
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    n = mhc_triton.TRITON_MAX_STREAMS + 1
    many = [t.to(DEVICE) for t in op_inputs(1, 1, n, 1, torch.float32)]
    hyper_connection(*many, sinkhorn_iters=2, eps=1e-6, norm_eps=NORM_EPS, backend="triton")
    fp32 = [t.to(DEVICE) for t in op_inputs(1, 1, 2, 3, torch.float32)]
    hyper_connection(*fp32, sinkhorn_iters=2, eps=1e-6, norm_eps=NORM_EPS, backend="triton")
    assert calls == ["triton"]  # only the last call reached the kernels


def test_create_graph_raises_naming_the_other_backends():
    inputs = to_device(op_inputs(1, 2, 2, 3, torch.float32))
    post, comb, collapsed = hyper_connection(*inputs, sinkhorn_iters=2, eps=1e-6, norm_eps=NORM_EPS, backend="triton")
    with pytest.raises(RuntimeError, match="first-order.*backend='torch'"):
        torch.autograd.grad(collapsed.sum() + post.sum(), inputs[0], create_graph=True)
    mix = to_device(mix_inputs(1, 2, 2, 3, torch.float32))
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad(hyper_mix(*mix, backend="triton").sum(), mix[0], create_graph=True)


def test_model_on_the_kernels_equals_the_model_on_torch():
    """A tiny mHC model (fp32) with op_backend='triton' gives the torch backend's loss and gradients."""
    torch.manual_seed(0)
    models = []
    for backend in ("torch", "triton"):
        model = randomise_mhc(MHCForCausalLM(tiny_config(num_hidden_layers=2, op_backend=backend)))
        models.append(model.to(DEVICE))
    models[1].load_state_dict(models[0].state_dict())
    ids = torch.randint(3, 97, (2, 7), device=DEVICE)
    losses = [m(input_ids=ids, labels=ids).loss for m in models]
    for loss in losses:
        loss.backward()
    assert abs(losses[1].item() - losses[0].item()) <= 64 * EPS32 * abs(losses[0].item())
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert max_rel(q.grad.cpu(), p.grad.cpu()) <= 2048 * EPS32, name
