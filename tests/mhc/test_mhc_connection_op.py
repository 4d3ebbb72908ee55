"""hyper_connection / hyper_head: the reference equals transformers' DeepseekV4HyperConnection / HyperHead, the torch
backend equals the reference (values and every gradient, every order), dtypes, autocast, dispatch and bad inputs."""

import pytest
import torch

from depthfusion_hf.models.mhc_connection import (
    hyper_connection,
    hyper_connection_reference,
    hyper_connection_torch,
    hyper_connection_weights_reference,
    hyper_head,
    hyper_head_reference,
    hyper_head_torch,
)

from .helpers import EPS, float_keeps_float64, max_rel, op_inputs, transformers_modules

EPS64, EPS32 = EPS[torch.float64], EPS[torch.float32]
NORM_EPS = 1e-6
# (B, T, n, D, sinkhorn_iters): every n from 1 to 5, widths that are not powers of two, one token, 1 and 20 iterations
SHAPES = [(2, 3, 1, 5, 3), (1, 4, 2, 7, 1), (2, 1, 3, 12, 20), (2, 3, 4, 16, 20), (1, 5, 5, 9, 4), (3, 2, 4, 1, 2)]
IDS = [f"B{b}T{t}n{n}D{d}it{i}" for b, t, n, d, i in SHAPES]


def connection_and_head(shape, dtype, seed=0):
    batch, tokens, n, dim, iters = shape
    streams, fn, base, scale = op_inputs(batch, tokens, n, dim, dtype, seed=seed)
    _, head_fn, head_base, head_scale = op_inputs(batch, tokens, n, dim, dtype, head=True, seed=seed + 1)
    return streams, (fn, base, scale), (head_fn, head_base, head_scale), iters


def grads(outputs, inputs, seed=1, dtypes=None):
    """Every input's gradient of a random linear function of the outputs (the same one for every backend): its
    weights are rounded to ``dtypes`` (default: the outputs' dtypes), then cast to the outputs' dtypes."""
    generator = torch.Generator().manual_seed(seed)
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    dtypes = dtypes or [o.dtype for o in outputs]
    weights = [torch.randn(o.shape, generator=generator).to(d).to(o.dtype) for o, d in zip(outputs, dtypes)]
    return torch.autograd.grad(outputs, inputs, weights)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_reference_is_transformers_deepseek_v4_in_float64(shape):
    """Same parameters in transformers' modules (their ``.float()`` kept at float64): post, comb, collapsed, the
    head's output and every gradient agree to float64 rounding (our reference is bit for bit theirs here)."""
    streams, params, head_params, iters = connection_and_head(shape, torch.float64)
    n, dim = shape[2], shape[3]
    connection, head = transformers_modules(n, dim, iters, 1e-6, NORM_EPS, *params, *head_params)
    connection.double(), head.double()
    with float_keeps_float64():
        theirs = (*connection(streams), head(streams))
    ours = (*hyper_connection(streams, *params, sinkhorn_iters=iters, eps=1e-6, norm_eps=NORM_EPS,
                              backend="reference"),
            hyper_head(streams, *head_params, eps=1e-6, norm_eps=NORM_EPS, backend="reference"))
    for name, got, want in zip(("post", "comb", "collapsed", "head"), ours, theirs):
        assert got.dtype == want.dtype == torch.float64
        assert max_rel(got, want) <= 16 * EPS64, name
    their_params = [*connection.parameters(), *head.parameters()]
    want = grads(theirs, [streams, *their_params])
    got = grads(ours, [streams, *params, *head_params])
    for name, g, w in zip(("streams", "fn", "base", "scale", "hc_fn", "hc_base", "hc_scale"), got, want):
        assert max_rel(g, w) <= 64 * EPS64, name


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_equals_transformers_deepseek_v4_in_float32(backend):
    """transformers' modules as they are (float32 arithmetic) on float32 inputs: ours agree to float32 rounding."""
    shape = (2, 5, 4, 24, 20)
    streams, params, head_params, iters = connection_and_head(shape, torch.float32)
    connection, head = transformers_modules(4, 24, iters, 1e-6, NORM_EPS, *params, *head_params)
    theirs = (*connection(streams), head(streams))
    ours = (*hyper_connection(streams, *params, sinkhorn_iters=iters, eps=1e-6, norm_eps=NORM_EPS, backend=backend),
            hyper_head(streams, *head_params, eps=1e-6, norm_eps=NORM_EPS, backend=backend))
    for name, got, want in zip(("post", "comb", "collapsed", "head"), ours, theirs):
        assert got.dtype == want.dtype == torch.float32
        assert max_rel(got, want) <= 64 * EPS32, name


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_torch_backend_equals_reference_in_float64(shape):
    streams, params, head_params, iters = connection_and_head(shape, torch.float64)
    kwargs = dict(sinkhorn_iters=iters, eps=1e-6, norm_eps=NORM_EPS)
    want = hyper_connection(streams, *params, backend="reference", **kwargs)
    got = hyper_connection(streams, *params, backend="torch", **kwargs)
    with torch.no_grad():  # the forward without autograd (_values) is the other formulation of the torch path
        got_values = hyper_connection(streams, *params, backend="torch", **kwargs)
    for name, g, v, w in zip(("post", "comb", "collapsed"), got, got_values, want):
        assert g.shape == v.shape == w.shape and g.dtype == v.dtype == w.dtype
        assert max_rel(g, w) <= 64 * EPS64 and max_rel(v, w) <= 64 * EPS64, name
    for name, g, w in zip(("streams", "fn", "base", "scale"), grads(got, [streams, *params]),
                          grads(want, [streams, *params])):
        assert max_rel(g, w) <= 256 * EPS64, name
    head_kwargs = dict(eps=1e-6, norm_eps=NORM_EPS)
    want = hyper_head(streams, *head_params, backend="reference", **head_kwargs)
    got = hyper_head(streams, *head_params, backend="torch", **head_kwargs)
    with torch.no_grad():
        got_values = hyper_head(streams, *head_params, backend="torch", **head_kwargs)
    assert max_rel(got, want) <= 64 * EPS64 and max_rel(got_values, want) <= 64 * EPS64
    for g, w in zip(grads(got, [streams, *head_params]), grads(want, [streams, *head_params])):
        assert max_rel(g, w) <= 256 * EPS64


@pytest.mark.parametrize(("n", "iters"), [(1, 1), (2, 3), (3, 2)])
def test_torch_backend_gradcheck(n, iters):
    """The custom Function's backward (written in torch ops) is exact to first order (float64)."""
    inputs = op_inputs(1, 2, n, 3, seed=n)
    assert torch.autograd.gradcheck(lambda *a: hyper_connection_torch(*a, iters, 1e-3, NORM_EPS), inputs)
    head_inputs = (inputs[0], *op_inputs(1, 2, n, 3, head=True, seed=n + 10)[1:])
    assert torch.autograd.gradcheck(lambda *a: hyper_head_torch(*a, 1e-3, NORM_EPS), head_inputs)


@pytest.mark.parametrize(("n", "iters"), [(1, 2), (2, 3)])
def test_torch_backend_gradgradcheck(n, iters):
    """... and to second order: its backward under create_graph recomputes from the inputs (float64)."""
    inputs = op_inputs(1, 1, n, 2, seed=n)
    assert torch.autograd.gradgradcheck(lambda *a: hyper_connection_torch(*a, iters, 1e-3, NORM_EPS), inputs)
    head_inputs = (inputs[0], *op_inputs(1, 1, n, 2, head=True, seed=n + 10)[1:])
    assert torch.autograd.gradgradcheck(lambda *a: hyper_head_torch(*a, 1e-3, NORM_EPS), head_inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_torch_backend_in_lower_precision_against_the_float64_truth(dtype):
    """Streams in ``dtype`` (fp32 parameters, as in the model): the weights are computed in fp32 (fp32 errors, not
    the streams' rounding) and ``collapsed`` and the streams' gradient are rounded once to ``dtype``."""
    streams, fn, base, scale = op_inputs(2, 7, 4, 24, torch.float32, seed=3)
    streams = streams.detach().to(dtype).requires_grad_()
    truth_inputs = [t.detach().double().requires_grad_() for t in (streams, fn, base, scale)]
    want = hyper_connection_reference(*truth_inputs, 20, 1e-6, NORM_EPS)
    got = hyper_connection(streams, fn, base, scale, sinkhorn_iters=20, eps=1e-6, norm_eps=NORM_EPS, backend="torch")
    assert [t.dtype for t in got] == [torch.float32, torch.float32, dtype]
    unit = EPS[dtype]
    for name, g, w in zip(("post", "comb"), got[:2], want[:2]):
        assert max_rel(g, w) <= 64 * EPS32, name
    # one rounding of each collapsed element (|err| <= unit |value|) on top of the fp32 arithmetic
    err = (got[2].double() - want[2].detach()).abs()
    assert (err <= unit * want[2].detach().abs() + 64 * EPS32 * want[2].detach().abs().max()).all()
    got_grads = grads(got, [streams, fn, base, scale])
    want_grads = grads(want, truth_inputs, dtypes=[t.dtype for t in got])  # the same (rounded) output gradients
    assert got_grads[0].dtype == dtype
    err = (got_grads[0].double() - want_grads[0]).abs()
    assert (err <= unit * want_grads[0].abs() + 256 * EPS32 * want_grads[0].abs().max()).all()
    for name, g, w in zip(("fn", "base", "scale"), got_grads[1:], want_grads[1:]):
        # fp32 gradients of the parameters: sums over B T = 14 tokens of products that carry the streams' rounding
        # only through the inputs the truth shares (it is computed from the rounded streams)
        assert g.dtype == torch.float32 and max_rel(g, w) <= 1024 * EPS32, name


def test_sinkhorn_result_is_doubly_stochastic_up_to_eps():
    """After the last column step every column of comb sums to s / (s + eps) (s: its sum before the step); with
    20 iterations every row sums to 1 to 1e-4 for these inputs."""
    streams, fn, base, scale = op_inputs(2, 6, 4, 8)
    _, comb, _ = hyper_connection(streams, fn, base, scale, sinkhorn_iters=20, eps=1e-6, norm_eps=NORM_EPS)
    columns, rows = comb.sum(-2), comb.sum(-1)
    assert ((columns - 1).abs() <= 4 * 1e-6).all()
    assert ((rows - 1).abs() <= 1e-4).all()
    pre, post, _ = hyper_connection_weights_reference(streams, fn, base, scale, 20, 1e-6, NORM_EPS)
    assert ((pre > 1e-6) & (pre < 1 + 1e-6)).all() and ((post > 0) & (post < 2)).all()


def test_strided_and_expanded_streams():
    """The embedding copied n times (stride 0) and a transposed layout give what contiguous streams give."""
    _, fn, base, scale = op_inputs(2, 3, 4, 6)
    embedding = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    expanded = embedding.unsqueeze(2).expand(-1, -1, 4, -1)
    transposed = expanded.detach().clone().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    for backend in ("reference", "torch"):
        want = hyper_connection(expanded.detach().clone(), fn, base, scale, sinkhorn_iters=5, eps=1e-6,
                                norm_eps=NORM_EPS, backend="reference")
        for streams in (expanded, transposed):
            got = hyper_connection(streams, fn, base, scale, sinkhorn_iters=5, eps=1e-6, norm_eps=NORM_EPS,
                                   backend=backend)
            for g, w in zip(got, want):
                assert max_rel(g, w) <= 64 * EPS64
        (grad,) = torch.autograd.grad(got[2].sum() + got[0].sum(), transposed)
        assert grad.shape == transposed.shape
    (grad,) = torch.autograd.grad(hyper_connection(expanded, fn, base, scale, sinkhorn_iters=5, eps=1e-6,
                                                   norm_eps=NORM_EPS, backend="torch")[2].sum(), embedding)
    assert grad.shape == embedding.shape


def test_autocast_leaves_the_arithmetic_and_dtypes_alone():
    """Under bf16 autocast the op computes exactly what it computes without it: fp32 weights, fp32 streams stay
    fp32 (the projection is not lowered to bf16)."""
    streams, fn, base, scale = op_inputs(2, 4, 4, 16, torch.float32)
    kwargs = dict(sinkhorn_iters=20, eps=1e-6, norm_eps=NORM_EPS)
    for backend in ("reference", "torch"):
        want = hyper_connection(streams, fn, base, scale, backend=backend, **kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = hyper_connection(streams, fn, base, scale, backend=backend, **kwargs)
            head = hyper_head(streams, fn[:4], base[:4], scale[:1], eps=1e-6, norm_eps=NORM_EPS, backend=backend)
        assert [t.dtype for t in got] == [torch.float32] * 3 and head.dtype == torch.float32
        for g, w in zip(got, want):
            assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_inference_mode_gives_the_autograd_path_numbers(dtype):
    streams, fn, base, scale = op_inputs(1, 3, 4, 8, dtype)  # requires_grad: the autograd Function
    want = hyper_connection(streams, fn, base, scale, sinkhorn_iters=20, eps=1e-6, norm_eps=NORM_EPS)
    assert all(w.grad_fn is not None for w in want)
    with torch.inference_mode():
        got = hyper_connection(streams, fn, base, scale, sinkhorn_iters=20, eps=1e-6, norm_eps=NORM_EPS)
    for g, w in zip(got, want):  # the same operations without autograd: the same numbers
        assert torch.equal(g, w.detach())


BAD = [
    (dict(streams=torch.zeros(2, 3, 4)), r"streams must have shape \[B, T, n, D\]"),
    (dict(streams=torch.zeros(2, 3, 0, 4)), r"n, D >= 1"),
    (dict(streams=torch.zeros(1, 2, 2, 3, dtype=torch.int64)), "streams must have a floating-point dtype"),
    (dict(fn=torch.zeros(8, 5)), r"fn must have shape \[\(2 \+ n\) n, n D\] = \(8, 6\)"),
    (dict(fn=torch.zeros(8, 6, dtype=torch.int32)), "fn must have a floating-point dtype"),
    (dict(base=torch.zeros(7)), r"base must have shape \[\(2 \+ n\) n\] = \(8,\)"),
    (dict(scale=torch.zeros(1)), r"scale must have shape \[3\]"),
    (dict(base="x"), "base must be a tensor"),
    (dict(sinkhorn_iters=0), "sinkhorn_iters must be an integer >= 1"),
    (dict(sinkhorn_iters=True), "sinkhorn_iters must be an integer >= 1"),
    (dict(eps=0.0), "eps must be a finite number > 0"),
    (dict(eps=float("nan")), "eps must be a finite number > 0"),
    (dict(norm_eps=-1.0), "norm_eps must be a finite number > 0"),
    (dict(backend="gpu"), "backend must be one of"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m[:24] for _, m in BAD])
def test_bad_inputs_are_rejected_naming_the_problem(change, message):
    args = dict(streams=torch.zeros(1, 2, 2, 3), fn=torch.zeros(8, 6), base=torch.zeros(8), scale=torch.ones(3),
                sinkhorn_iters=2, eps=1e-6, norm_eps=1e-6, backend=None) | change
    with pytest.raises(ValueError, match=message):
        hyper_connection(args.pop("streams"), args.pop("fn"), args.pop("base"), args.pop("scale"), **args)


def test_bad_head_inputs_and_devices():
    streams = torch.zeros(1, 2, 2, 3)
    with pytest.raises(ValueError, match=r"fn must have shape \[n, n D\] = \(2, 6\)"):
        hyper_head(streams, torch.zeros(8, 6), torch.zeros(2), torch.ones(1), eps=1e-6, norm_eps=1e-6)
    with pytest.raises(ValueError, match=r"scale must have shape \[1\]"):
        hyper_head(streams, torch.zeros(2, 6), torch.zeros(2), torch.ones(3), eps=1e-6, norm_eps=1e-6)
    with pytest.raises(ValueError, match="must be on the streams' device"):
        hyper_head(streams, torch.zeros(2, 6, device="meta"), torch.zeros(2), torch.ones(1), eps=1e-6, norm_eps=1e-6)


def test_head_reference_is_the_pre_part_of_the_connection():
    """hyper_head with fn, base, scale = the pre rows of a connection's gives that connection's collapsed."""
    streams, fn, base, scale = op_inputs(2, 3, 3, 4)
    _, _, collapsed = hyper_connection_reference(streams, fn, base, scale, 5, 1e-6, NORM_EPS)
    head = hyper_head_reference(streams, fn[:3], base[:3], scale[:1], 1e-6, NORM_EPS)
    assert max_rel(head, collapsed) <= 4 * EPS64
