"""The ``attention_residual`` op (AttnRes, PAPERS.md section 4): reference and torch backends on CPU.

Every path is compared with the reference evaluated in float64 on the same inputs (values, softmax
weights, gradients of query, norm weight and every source), in fp32, bf16 and fp16, on awkward shapes.
The Triton kernel has the same checks in ``tests/kernels/test_attnres_triton.py`` (interpreted).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import depthfusion_hf.ops
from depthfusion_hf.models import attnres, depthfusion_common
from depthfusion_hf.models.attnres import attention_residual, attnres_reference
from tests.attnres._op_cases import (
    K_FP32,
    SHAPES,
    assert_scaled_close,
    check_run,
    error_scales,
    make_grads,
    make_inputs,
    run_and_check,
    shape_id,
    truth,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@pytest.fixture(params=["reference", "torch-list", "torch-small"])
def backend(request, monkeypatch):
    """The CPU paths: the reference, the torch custom Function over the list, the stacked small path."""
    if request.param == "torch-list":
        monkeypatch.setattr(attnres, "SMALL_NUMEL", -1)
    elif request.param == "torch-small":
        monkeypatch.setattr(attnres, "SMALL_NUMEL", 1 << 40)
    return request.param.split("-")[0]


def test_exported_from_ops():
    assert depthfusion_hf.ops.attention_residual is attention_residual
    assert "attention_residual" in depthfusion_hf.ops.__all__


def test_reference_against_hand_computation():
    """Two sources, D = 2, one token: the equations of PAPERS.md section 4 evaluated by hand."""
    v0 = torch.tensor([[[3.0, 4.0]]], dtype=torch.float64)
    v1 = torch.tensor([[[1.0, -1.0]]], dtype=torch.float64)
    w = torch.tensor([0.5, 2.0], dtype=torch.float64)
    g = torch.tensor([2.0, 1.0], dtype=torch.float64)
    eps = 1e-6
    k0 = [2.0 * 3.0 / math.sqrt(12.5 + eps), 1.0 * 4.0 / math.sqrt(12.5 + eps)]
    k1 = [2.0 * 1.0 / math.sqrt(1.0 + eps), 1.0 * -1.0 / math.sqrt(1.0 + eps)]
    s0, s1 = 0.5 * k0[0] + 2.0 * k0[1], 0.5 * k1[0] + 2.0 * k1[1]
    a0 = math.exp(s0) / (math.exp(s0) + math.exp(s1))
    expected_h = torch.tensor([[[a0 * 3.0 + (1 - a0) * 1.0, a0 * 4.0 + (1 - a0) * -1.0]]], dtype=torch.float64)
    h, alpha = attnres_reference(w, [v0, v1], g, eps)
    assert_scaled_close(h, expected_h, torch.float64, 8, "h")
    assert_scaled_close(alpha, torch.tensor([[[a0, 1 - a0]]], dtype=torch.float64), torch.float64, 8, "alpha")


def test_zero_query_is_the_uniform_average(backend):
    """The paper's initialisation (w = 0): every source gets weight 1/N, h is the plain mean."""
    _, sources, weight = make_inputs((2, 7, 12, 5), torch.float32)
    query = torch.zeros(12)
    h, alpha = attention_residual(query, sources, weight, return_weights=True, backend=backend)
    mean = torch.stack([x.detach().double() for x in sources]).mean(0)
    abs_mean = torch.stack([x.detach().double().abs() for x in sources]).mean(0)
    assert_scaled_close(h, mean, torch.float32, K_FP32, "h", scale=abs_mean)
    assert_scaled_close(alpha, torch.full((2, 7, 5), 0.2, dtype=torch.float64), torch.float32, K_FP32, "alpha")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[shape_id(s) for s in SHAPES])
def test_matches_float64_truth(backend, shape, dtype):
    run_and_check(shape, dtype, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_non_contiguous_sources_and_gradient(backend, dtype):
    shape = (2, 9, 20, 3)
    query, sources, weight = make_inputs(shape, dtype, non_contiguous=True)
    assert not any(x.is_contiguous() for x in sources)
    grad_h = torch.randn(2, 20, 9).to(dtype).transpose(1, 2)  # a non-contiguous output gradient too
    _, grad_alpha = make_grads(shape, dtype)
    check_run(query, sources, weight, grad_h, grad_alpha, backend)


def test_last_dim_strided_sources(backend):
    """Sources that are every other element of a wider tensor (stride 2 along D)."""
    wide = torch.randn(3, 2, 5, 14, dtype=torch.float32)
    sources = [wide[i, ..., ::2].requires_grad_() for i in range(3)]
    assert all(x.stride(-1) == 2 for x in sources)
    query, _, weight = make_inputs((2, 5, 7, 3), torch.float32)
    grad_h, grad_alpha = make_grads((2, 5, 7, 3), torch.float32)
    check_run(query, sources, weight, grad_h, grad_alpha, backend)


def test_stacked_tensor_of_sources(backend):
    """One [N, B, T, D] tensor is unbound into N sources; its gradient is the stack of theirs."""
    query, sources, weight = make_inputs((2, 4, 10, 3), torch.float32)
    stacked = torch.stack([x.detach() for x in sources]).requires_grad_()
    h = attention_residual(query, stacked, weight, backend=backend)
    grad_h, _ = make_grads((2, 4, 10, 3), torch.float32)
    (d_stacked,) = torch.autograd.grad(h, [stacked], grad_h)
    _, _, grads64 = truth(query, sources, weight, grad_h, None)
    scales = error_scales(query, sources, weight, grad_h, None)["grads"]
    assert_scaled_close(d_stacked, torch.stack(grads64[2:]), torch.float32, K_FP32, "d_stacked",
                        torch.stack(scales[2:]))


def test_same_tensor_twice(backend):
    """A source listed twice gets the sum of both gradients (autograd adds the two returned gradients)."""
    query, (x, y), weight = make_inputs((2, 5, 12, 2), torch.float32)
    grad_h, _ = make_grads((2, 5, 12, 3), torch.float32)
    h = attention_residual(query, [x, y, x], weight, backend=backend)
    got = torch.autograd.grad(h, [query, weight, x, y], grad_h)
    xr, yr = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    h64 = attention_residual(query, [xr, yr, xr.clone()], weight, backend="reference")
    want = torch.autograd.grad(h64, [query, weight, xr, yr], grad_h)
    for a, e in zip(got, want):
        assert_scaled_close(a, e, torch.float32, 64, "gradient")


@pytest.mark.parametrize("shape", SHAPES, ids=[shape_id(s) for s in SHAPES])
def test_weights_are_a_softmax(backend, shape):
    query, sources, weight = make_inputs(shape, torch.bfloat16)
    h, alpha = attention_residual(query, sources, weight, return_weights=True, backend=backend)
    batch, seq, dim, n_src = shape
    assert h.shape == (batch, seq, dim) and h.dtype == torch.bfloat16
    assert alpha.shape == (batch, seq, n_src) and alpha.dtype == torch.float32
    assert (alpha >= 0).all()
    assert_scaled_close(alpha.sum(-1), torch.ones(batch, seq, dtype=torch.float64), torch.float32, n_src + 1, "sum")
    assert not isinstance(attention_residual(query, sources, weight, backend=backend), tuple)


@pytest.mark.parametrize("batch,seq", [(0, 4), (2, 0)])
def test_empty_token_dims(backend, batch, seq):
    query, sources, weight = make_inputs((max(batch, 1), max(seq, 1), 6, 3), torch.float32)
    sources = [x.detach()[:batch, :seq].requires_grad_() for x in sources]
    h, alpha = attention_residual(query, sources, weight, return_weights=True, backend=backend)
    assert h.shape == (batch, seq, 6) and alpha.shape == (batch, seq, 3)
    grads = torch.autograd.grad(h.sum(), [query, weight, *sources])
    assert all(torch.count_nonzero(gr) == 0 for gr in grads)
    assert grads[0].shape == (6,) and grads[2].shape == (batch, seq, 6)


def test_partial_requires_grad(backend):
    """Frozen query/norm weight or some frozen sources: None for those, exact values for the rest."""
    shape = (2, 6, 10, 3)
    query, sources, weight = make_inputs(shape, torch.float32)
    grad_h, _ = make_grads(shape, torch.float32)
    _, _, grads64 = truth(query, sources, weight, grad_h, None)
    scales = error_scales(query, sources, weight, grad_h, None)["grads"]
    frozen = [sources[0], sources[1].detach(), sources[2]]
    h = attention_residual(query.detach(), frozen, weight.detach(), backend=backend)
    d0, d2 = torch.autograd.grad(h, [frozen[0], frozen[2]], grad_h)
    assert_scaled_close(d0, grads64[2], torch.float32, K_FP32, "d_sources[0]", scales[2])
    assert_scaled_close(d2, grads64[4], torch.float32, K_FP32, "d_sources[2]", scales[4])
    h = attention_residual(query, [x.detach() for x in sources], weight, backend=backend)
    dq, dg = torch.autograd.grad(h, [query, weight], grad_h)
    assert_scaled_close(dq, grads64[0], torch.float32, K_FP32, "d_query", scales[0])
    assert_scaled_close(dg, grads64[1], torch.float32, K_FP32, "d_key_norm_weight", scales[1])


def test_bf16_parameters(backend):
    """A bf16 model: query and norm weight in bf16 too; their gradients come back in bf16."""
    shape = (2, 5, 16, 4)
    query, sources, weight = make_inputs(shape, torch.bfloat16, param_dtype=torch.bfloat16)
    grad_h, grad_alpha = make_grads(shape, torch.bfloat16)
    check_run(query, sources, weight, grad_h, grad_alpha, backend)
    h, alpha = attention_residual(query, sources, weight, return_weights=True, backend=backend)
    d_query, d_weight = torch.autograd.grad(h, [query, weight], grad_h)
    assert d_query.dtype == torch.bfloat16 and d_weight.dtype == torch.bfloat16


@pytest.mark.parametrize("small", [False, True], ids=["list", "small"])
def test_gradcheck_torch_backward(monkeypatch, small):
    """The custom backward (and the stacked path) in float64, first and second order, with alpha as an output."""
    monkeypatch.setattr(attnres, "SMALL_NUMEL", 1 << 40 if small else -1)
    query, sources, weight = make_inputs((1, 2, 3, 3), torch.float64, param_dtype=torch.float64)

    def fn(q, g, *xs):
        return attention_residual(q, list(xs), g, return_weights=True, backend="torch")

    assert torch.autograd.gradcheck(fn, (query, weight, *sources))
    assert torch.autograd.gradgradcheck(fn, (query, weight, *sources))


def test_double_backward_matches_reference(backend):
    """A gradient penalty (create_graph=True) gives the reference's second-order gradients (float64)."""
    shape = (2, 4, 9, 3)

    def penalty(backend_name):
        query, sources, weight = make_inputs(shape, torch.float64, param_dtype=torch.float64)
        h = attention_residual(query, sources, weight, backend=backend_name)
        grads = torch.autograd.grad((h * h).sum(), [query, *sources], create_graph=True)
        loss = sum((gr * gr).sum() for gr in grads)
        return torch.autograd.grad(loss, [query, weight, *sources])

    for a, e in zip(penalty(backend), penalty("reference")):
        assert_scaled_close(a, e, torch.float64, 64, "second-order gradient")


def test_float64_stays_float64(backend):
    query, sources, weight = make_inputs((1, 3, 6, 2), torch.float64, param_dtype=torch.float64)
    h, alpha = attention_residual(query, sources, weight, return_weights=True, backend=backend)
    assert h.dtype == torch.float64 and alpha.dtype == torch.float64
    grad_h, grad_alpha = make_grads((1, 3, 6, 2), torch.float64)
    check_run(query, sources, weight, grad_h, grad_alpha, backend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("sources_dtype", ["fp32", "embedding-fp32", "half"])
def test_autocast_keeps_the_promoted_dtype(backend, dtype, sources_dtype):
    """Under CPU autocast the compute dtype stays the promoted dtype of the inputs, as DenseFormer's DWA and a
    Llama's residual sum (``x + f(x)`` stays fp32 under bf16 autocast): an fp32 embedding beside half-precision
    outputs (what a model gives), all-fp32 or all-half sources with fp32 parameters give fp32, bit for bit what the
    call gives without autocast, each source read in its own dtype (before: every input was cast to the autocast
    dtype and h came back in it); gradients in the inputs' own dtypes, equal to the float64 reference."""
    shape = (2, 5, 16, 4)
    query, sources, weight = make_inputs(shape, torch.float32)
    half = {"fp32": [], "embedding-fp32": [1, 2, 3], "half": [0, 1, 2, 3]}[sources_dtype]
    sources = [x.detach().to(dtype).requires_grad_() if i in half else x for i, x in enumerate(sources)]
    grad_h, grad_alpha = make_grads(shape, torch.float32)
    want = attention_residual(query, sources, weight, return_weights=True, backend=backend)
    with torch.autocast("cpu", dtype=dtype):
        h, alpha = attention_residual(query, sources, weight, return_weights=True, backend=backend)
        assert h.dtype == alpha.dtype == torch.float32
        assert torch.equal(h, want[0]) and torch.equal(alpha, want[1])
        check_run(query, sources, weight, grad_h, grad_alpha, backend)
    grads = torch.autograd.grad(h, [query, *sources], grad_h)
    assert [g.dtype for g in grads] == [torch.float32] + [x.dtype for x in sources]


@pytest.mark.parametrize(("source_dtype", "param_dtype", "expected"), [
    (torch.bfloat16, torch.float32, torch.float32),  # half-precision sources, an fp32 call: fp32
    (torch.float32, torch.bfloat16, torch.float32),  # bf16 calls in an fp32 model: fp32 (not rounded to bf16)
    (torch.float32, torch.float64, torch.float64),  # fp32 calls in a float64 model: float64
    (torch.float16, torch.float16, torch.float16),
])
def test_compute_dtype_is_the_promoted_input_dtype(backend, source_dtype, param_dtype, expected):
    shape = (2, 3, 10, 3)
    query, sources, weight = make_inputs(shape, source_dtype, param_dtype=param_dtype)
    h = attention_residual(query, sources, weight, backend=backend)
    assert h.dtype == expected
    grad_h, grad_alpha = make_grads(shape, source_dtype)
    check_run(query, sources, weight, grad_h, grad_alpha, backend)


def test_mixed_source_dtypes_are_promoted(backend):
    """An fp32 source beside bf16 ones (no autocast): computed in fp32, as the reference does on fp32 copies."""
    shape = (2, 4, 12, 3)
    query, sources, weight = make_inputs(shape, torch.float32)
    sources = [sources[0], *(x.detach().bfloat16().requires_grad_() for x in sources[1:])]
    grad_h, grad_alpha = make_grads(shape, torch.float32)
    check_run(query, sources, weight, grad_h, grad_alpha, backend)


def test_without_autograd_equals_with_it(backend):
    """Under ``no_grad`` / ``inference_mode`` the dispatcher runs the forward without an autograd node: the same
    values bit for bit."""
    query, sources, weight = make_inputs((2, 7, 12, 5), torch.float32)
    want = attention_residual(query, sources, weight, return_weights=True, backend=backend)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            got = attention_residual(query, sources, weight, return_weights=True, backend=backend)
        assert all(torch.equal(a, b.detach()) for a, b in zip(got, want))


def test_meta_device(backend):
    """A forward on the meta device (used to size and plan models) gives the shapes and dtypes (before: the
    autocast query failed on 'meta')."""
    query, weight = torch.zeros(8, device="meta"), torch.ones(8, device="meta")
    sources = [torch.zeros(2, 3, 8, device="meta") for _ in range(4)]
    h, alpha = attention_residual(query, sources, weight, return_weights=True, backend=backend)
    assert h.device.type == alpha.device.type == "meta"
    assert h.shape == (2, 3, 8) and alpha.shape == (2, 3, 4) and alpha.dtype == torch.float32


def test_eps_is_used(backend):
    """A large eps changes the keys exactly as RMSNorm's eps does."""
    query, sources, weight = make_inputs((1, 4, 8, 3), torch.float64, param_dtype=torch.float64)
    h = attention_residual(query, sources, weight, eps=0.5, backend=backend)
    h64, _ = attnres_reference(query, sources, weight, 0.5)
    h_small, _ = attnres_reference(query, sources, weight, 1e-6)
    assert_scaled_close(h, h64, torch.float64, 64, "h")
    assert (h64 - h_small).abs().max() > 1e-3


# ---------------------------------------------------------------- dispatch


@pytest.mark.parametrize("where", ["sources", "query"])
def test_float64_work_is_routed_away_from_triton(monkeypatch, where):
    """The dispatcher sends float64 work asked of Triton to the torch path (the kernel computes in fp32)."""

    def kernel(*args):
        raise AssertionError("the Triton kernel must not receive float64 work")

    monkeypatch.setattr(depthfusion_common, "triton_available", lambda: True)
    monkeypatch.setattr(depthfusion_common, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(attnres, "triton_attention_residual", kernel)
    monkeypatch.setattr(attnres, "TRITON_DTYPES", (torch.float32, torch.bfloat16, torch.float16))
    dtype = torch.float64 if where == "sources" else torch.float32
    query, sources, weight = make_inputs((1, 3, 6, 2), dtype, param_dtype=torch.float64)
    h = attention_residual(query, sources, weight, backend="triton")
    h64, _, _ = truth(query, sources, weight, torch.zeros(1, 3, 6), None)
    assert h.dtype == torch.float64  # the promoted dtype of the inputs
    assert_scaled_close(h, h64, torch.float64, 64, "h")


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the kernel accepts these tensors here (CUDA or interpreted Triton)")
def test_kernel_rejects_cpu_tensors_without_interpreter():
    """Called directly (bypassing resolve_backend), the kernel refuses CPU tensors instead of crashing."""
    from depthfusion_hf.models import attnres_triton

    if attnres_triton.triton is None:
        pytest.skip("Triton does not import here")
    query, sources, weight = make_inputs((1, 2, 4, 2), torch.float32)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        attnres_triton.triton_attention_residual(query, sources, weight, 1e-6, torch.float32)


# ---------------------------------------------------------------- bad inputs

_Q = torch.zeros(4)
_G = torch.ones(4)
_X = torch.zeros(2, 3, 4)

# (id, kwargs for attention_residual, message regex). Each category is listed in the report.
BAD_INPUTS = {
    "container": [
        ("empty-list", dict(sources=[]), "at least one tensor"),
        ("none", dict(sources=None), "sources must be a sequence"),
        ("string", dict(sources="abc"), "sources must be a sequence"),
        ("3d-tensor", dict(sources=_X), r"sources must be a sequence .* or one tensor \[N, B, T, D\]"),
        ("element-not-tensor", dict(sources=[_X, [[1.0]]]), r"sources\[1\] must be a torch.Tensor"),
    ],
    "shape": [
        ("2d-source", dict(sources=[torch.zeros(3, 4)]), r"sources must have shape \[B, T, D\]"),
        ("4d-source", dict(sources=[torch.zeros(1, 2, 3, 4)]), r"sources must have shape \[B, T, D\]"),
        ("mismatched-shapes", dict(sources=[_X, torch.zeros(2, 5, 4)]), "share shape and device"),
        ("zero-hidden", dict(sources=[torch.zeros(2, 3, 0)], query=torch.zeros(0), key_norm_weight=torch.ones(0)),
         "hidden size D >= 1"),
        ("query-wrong-d", dict(query=torch.zeros(5)), r"query must have shape \[D=4\]"),
        ("query-2d", dict(query=torch.zeros(1, 4)), r"query must have shape \[D=4\]"),
        ("query-scalar", dict(query=torch.tensor(0.0)), r"query must have shape \[D=4\]"),
        ("weight-wrong-d", dict(key_norm_weight=torch.ones(3)), r"key_norm_weight must have shape \[D=4\]"),
    ],
    "dtype": [
        ("int-sources", dict(sources=[torch.zeros(2, 3, 4, dtype=torch.int64)]), "floating dtype"),
        ("bool-sources", dict(sources=[torch.zeros(2, 3, 4, dtype=torch.bool)]), "floating dtype"),
        ("complex-sources", dict(sources=[torch.zeros(2, 3, 4, dtype=torch.complex64)]), "floating dtype"),
        ("int-query", dict(query=torch.zeros(4, dtype=torch.int32)), "query must have a floating dtype"),
        ("int-weight", dict(key_norm_weight=torch.ones(4, dtype=torch.int64)), "key_norm_weight must have a floating"),
        ("int-among-floats", dict(sources=[_X, torch.zeros(2, 3, 4, dtype=torch.int32)]),
         r"sources\[1\] must have a floating"),
        ("query-not-tensor", dict(query=[0.0] * 4), "query must be a torch.Tensor"),
    ],
    "device": [
        ("sources-on-two-devices", dict(sources=[_X, torch.zeros(2, 3, 4, device="meta")]),
         "share shape and device"),
        ("query-elsewhere", dict(query=torch.zeros(4, device="meta")), "query must be on the sources' device"),
        ("weight-elsewhere", dict(key_norm_weight=torch.ones(4, device="meta")),
         "key_norm_weight must be on the sources' device"),
    ],
    "options": [
        ("eps-zero", dict(eps=0.0), "eps must be a positive finite float"),
        ("eps-negative", dict(eps=-1e-6), "eps must be a positive finite float"),
        ("eps-nan", dict(eps=float("nan")), "eps must be a positive finite float"),
        ("eps-inf", dict(eps=float("inf")), "eps must be a positive finite float"),
        ("eps-string", dict(eps="1e-6"), "eps must be a positive finite float"),
        ("eps-bool", dict(eps=True), "eps must be a positive finite float"),
        ("return-weights-int", dict(return_weights=1), "return_weights must be a bool"),
        ("backend-unknown", dict(backend="cuda"), "backend must be one of"),
        ("backend-not-str", dict(backend=1), "backend must be one of"),
    ],
}
_BAD_CASES = [(cat, *case) for cat, cases in BAD_INPUTS.items() for case in cases]


@pytest.mark.parametrize(("category", "case_id", "kwargs", "message"), _BAD_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in _BAD_CASES])
def test_bad_inputs_are_rejected(category, case_id, kwargs, message):
    args = dict(query=_Q, sources=[_X, _X], key_norm_weight=_G)
    args.update(kwargs)
    query, sources, weight = args.pop("query"), args.pop("sources"), args.pop("key_norm_weight")
    with pytest.raises(ValueError, match=message):
        attention_residual(query, sources, weight, **args)


# ---------------------------------------------------------------- fuzz


@st.composite
def _cases(draw):
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 17)), draw(st.integers(1, 40)), draw(st.integers(1, 6)))
    return dict(
        shape=shape,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        path=draw(st.sampled_from(["reference", "torch-list", "torch-small"])),
        layout=draw(st.sampled_from(["contiguous", "transposed", "strided"])),
        param_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        seed=draw(st.integers(0, 2**16)),
        query_scale=draw(st.sampled_from([0.0, 0.5, 3.0, 8.0])),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_cases())
def test_fuzz_against_float64_truth(case, monkeypatch):
    """Shapes, strides, dtypes, parameter dtypes, softmax sharpness and backends, against the float64 reference."""
    path = case["path"]
    monkeypatch.setattr(attnres, "SMALL_NUMEL", {"torch-list": -1, "torch-small": 1 << 40}.get(path, 1 << 14))
    run_and_check(case["shape"], case["dtype"], path.split("-")[0], seed=case["seed"], query_scale=case["query_scale"],
                  non_contiguous=case["layout"], param_dtype=case["param_dtype"])
