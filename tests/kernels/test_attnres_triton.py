"""The fused Triton ``attention_residual`` against the float64 reference: values, weights, gradients.

Runs in-process on CUDA, or on CPU when ``TRITON_INTERPRET=1`` was set before the kernels were
imported; a plain CPU ``pytest`` run executes this module in an interpreted child process
(``test_attnres_triton_interpreted.py``) and skips it here.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kernels.interpret import kernels_run_in_process

if not kernels_run_in_process():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (run through test_attnres_triton_interpreted.py)",
                allow_module_level=True)

from depthfusion_hf.models import attnres, attnres_triton, depthfusion_common  # noqa: E402
from depthfusion_hf.models.attnres import attention_residual  # noqa: E402
from tests.attnres._op_cases import (  # noqa: E402
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

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_is_available_and_auto_dispatch():
    assert depthfusion_common.triton_available()
    assert attnres.triton_attention_residual is attnres_triton.triton_attention_residual
    expected = "triton" if DEVICE == "cuda" else "torch"  # auto uses Triton for CUDA tensors only
    assert attnres.resolve_backend(None, torch.device(DEVICE)) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[shape_id(s) for s in SHAPES])
def test_matches_float64_truth(shape, dtype):
    run_and_check(shape, dtype, "triton", DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_many_tiles_programs_and_masked_tail(monkeypatch, dtype):
    """Several token tiles per backward program, a partial last tile, and the per-program du partials."""
    if DEVICE == "cpu":
        monkeypatch.setattr(attnres_triton, "INTERPRET_TILE_ELEMENTS", 64)  # D=20 -> 2 tokens per tile
        monkeypatch.setattr(attnres_triton, "INTERPRET_MAX_PROGRAMS", 3)  # 32 tiles over 3 programs
        shape = (1, 63, 20, 4)
    else:
        shape = (3, 2741, 20, 4)
    run_and_check(shape, dtype, "triton", DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_non_contiguous_sources_and_gradient(dtype):
    shape = (2, 9, 20, 3)
    query, sources, weight = make_inputs(shape, dtype, DEVICE, non_contiguous=True)
    assert not any(x.is_contiguous() for x in sources)
    grad_h = torch.randn(2, 20, 9).to(DEVICE, dtype).transpose(1, 2)
    _, grad_alpha = make_grads(shape, dtype, DEVICE)
    check_run(query, sources, weight, grad_h, grad_alpha, "triton")


def test_stacked_tensor_views_with_offsets():
    """A [N, B, T, D] tensor is unbound into views at non-zero offsets: the pointer arguments must honour them."""
    query, sources, weight = make_inputs((2, 4, 10, 3), torch.float32, DEVICE)
    stacked = torch.stack([x.detach() for x in sources]).requires_grad_()
    grad_h, _ = make_grads((2, 4, 10, 3), torch.float32, DEVICE)
    h = attention_residual(query, stacked, weight, backend="triton")
    (d_stacked,) = torch.autograd.grad(h, [stacked], grad_h)
    h64, _, grads64 = truth(query, sources, weight, grad_h, None)
    scales = error_scales(query, sources, weight, grad_h, None)
    assert_scaled_close(h, h64, torch.float32, K_FP32, "h", scales["h"][0])
    assert_scaled_close(d_stacked, torch.stack(grads64[2:]), torch.float32, K_FP32, "d_stacked",
                        torch.stack(scales["grads"][2:]))


def test_same_tensor_twice():
    """A source listed twice: two pointer arguments to one tensor; its gradients add up."""
    query, (x, y), weight = make_inputs((2, 5, 12, 2), torch.float32, DEVICE)
    grad_h, _ = make_grads((2, 5, 12, 3), torch.float32, DEVICE)
    h = attention_residual(query, [x, y, x], weight, backend="triton")
    got = torch.autograd.grad(h, [query, weight, x, y], grad_h)
    h_ref = attention_residual(query, [x, y, x], weight, backend="reference")
    want = torch.autograd.grad(h_ref, [query, weight, x, y], grad_h)
    for a, e in zip(got, want):
        assert_scaled_close(a, e, torch.float32, 64, "gradient")


def test_partial_requires_grad():
    """Only sources (no du), only query and norm weight (no dx), some sources frozen, no alpha gradient."""
    shape = (2, 6, 10, 3)
    query, sources, weight = make_inputs(shape, torch.float32, DEVICE)
    grad_h, _ = make_grads(shape, torch.float32, DEVICE)
    _, _, grads64 = truth(query, sources, weight, grad_h, None)
    scales = error_scales(query, sources, weight, grad_h, None)["grads"]
    frozen = [sources[0], sources[1].detach(), sources[2]]
    h = attention_residual(query.detach(), frozen, weight.detach(), backend="triton")
    d0, d2 = torch.autograd.grad(h, [frozen[0], frozen[2]], grad_h)
    assert_scaled_close(d0, grads64[2], torch.float32, K_FP32, "d_sources[0]", scales[2])
    assert_scaled_close(d2, grads64[4], torch.float32, K_FP32, "d_sources[2]", scales[4])
    h = attention_residual(query, [x.detach() for x in sources], weight, backend="triton")
    dq, dg = torch.autograd.grad(h, [query, weight], grad_h)
    assert_scaled_close(dq, grads64[0], torch.float32, K_FP32, "d_query", scales[0])
    assert_scaled_close(dg, grads64[1], torch.float32, K_FP32, "d_key_norm_weight", scales[1])


def test_gradient_through_the_weights_only():
    """A loss on alpha alone (no gradient for h) still reaches the query and the sources."""
    shape = (2, 5, 12, 4)
    query, sources, weight = make_inputs(shape, torch.float32, DEVICE)
    _, grad_alpha = make_grads(shape, torch.float32, DEVICE)
    _, alpha = attention_residual(query, sources, weight, return_weights=True, backend="triton")
    grads = torch.autograd.grad(alpha, [query, weight, *sources], grad_alpha)
    no_grad_h = torch.zeros(2, 5, 12, device=DEVICE)
    _, _, grads64 = truth(query, sources, weight, no_grad_h, grad_alpha)
    scales = error_scales(query, sources, weight, no_grad_h, grad_alpha)["grads"]
    for i, (a, e, sc) in enumerate(zip(grads, grads64, scales)):
        assert_scaled_close(a, e, torch.float32, K_FP32, f"grad[{i}]", sc)


def test_backward_is_deterministic():
    """Same inputs, same kernel: bitwise-identical gradients (fixed-order partial sums, no atomics)."""
    query, sources, weight = make_inputs((2, 37, 24, 5), torch.float32, DEVICE)
    grad_h, _ = make_grads((2, 37, 24, 5), torch.float32, DEVICE)
    first = torch.autograd.grad(attention_residual(query, sources, weight, backend="triton"), [query, weight], grad_h)
    second = torch.autograd.grad(attention_residual(query, sources, weight, backend="triton"), [query, weight], grad_h)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_double_backward_raises_a_clear_error():
    query, sources, weight = make_inputs((1, 3, 8, 2), torch.float32, DEVICE)
    h = attention_residual(query, sources, weight, backend="triton")
    with pytest.raises(RuntimeError, match="first-order only.*backend='torch' or backend='reference'"):
        torch.autograd.grad((h * h).sum(), [query], create_graph=True)


def test_float64_is_routed_to_torch_and_kernel_rejects_it():
    query, sources, weight = make_inputs((1, 3, 6, 2), torch.float64, DEVICE, param_dtype=torch.float64)
    h, alpha = attention_residual(query, sources, weight, return_weights=True, backend="triton")
    h64, alpha64, _ = truth(query, sources, weight, torch.zeros(1, 3, 6, device=DEVICE), None)
    assert h.dtype == torch.float64 and alpha.dtype == torch.float64
    assert_scaled_close(h, h64, torch.float64, 64, "h")
    with pytest.raises(ValueError, match="Triton attention_residual computes in fp32"):
        attnres_triton.triton_attention_residual(query, sources, weight, 1e-6, torch.float64)
    with pytest.raises(ValueError, match="Triton attention_residual computes in fp32"):  # a float64 source
        attnres_triton.triton_attention_residual(query.float(), [sources[0].float(), sources[1]], weight.float(),
                                                 1e-6, torch.float32)


@pytest.mark.parametrize("batch,seq", [(0, 4), (2, 0)])
def test_empty_token_dims(batch, seq):
    query, sources, weight = make_inputs((1, 1, 6, 3), torch.float32, DEVICE)
    sources = [torch.zeros(batch, seq, 6, device=DEVICE, requires_grad=True) for _ in range(3)]
    h, alpha = attention_residual(query, sources, weight, return_weights=True, backend="triton")
    assert h.shape == (batch, seq, 6) and alpha.shape == (batch, seq, 3)
    grads = torch.autograd.grad(h.sum(), [query, weight, *sources])
    assert all(torch.count_nonzero(g) == 0 for g in grads)


@st.composite
def _cases(draw):
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 40)), draw(st.integers(1, 5)))
    return dict(
        shape=shape,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        layout=draw(st.sampled_from(["contiguous", "transposed", "strided"])),
        param_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        seed=draw(st.integers(0, 2**16)),
        query_scale=draw(st.sampled_from([0.0, 0.5, 3.0, 8.0])),
    )


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_cases())
def test_fuzz_against_float64_truth(case):
    """Shapes, strides, dtypes, parameter dtypes and softmax sharpness through the fused kernels."""
    run_and_check(case["shape"], case["dtype"], "triton", DEVICE, seed=case["seed"], query_scale=case["query_scale"],
                  non_contiguous=case["layout"], param_dtype=case["param_dtype"])


# ---------------------------------------------------------------- issue 20: what the interpreter hid


def record_launches(monkeypatch) -> list[tuple[str, tuple]]:
    """``(kernel name, positional arguments)`` of every launch of the AttnRes kernels from now on."""
    launches = []
    for kernel in (getattr(attnres_triton, name) for name in dir(attnres_triton) if name.endswith("_kernel")):
        def run(*args, _kernel=kernel, _run=kernel.run, **kwargs):
            launches.append((_kernel.fn.__name__, args))
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    return launches


def test_launches_take_the_sources_as_pointer_arguments(monkeypatch):
    """The kernels read the sources through pointer arguments, at most ``SOURCES_PER_LAUNCH`` per launch with
    launches chained, not through a table of ``data_ptr()``s built on the host every call (a pageable copy a CUDA
    graph cannot capture, which breaks dynamo and makes scalar loads): no launch gets an integer tensor, and 25
    sources take ceil(25 / 8) = 4 chained launches of each kernel (values: ``test_matches_float64_truth``)."""
    launches = record_launches(monkeypatch)
    query, sources, weight = make_inputs((1, 3, 8, 25), torch.float32, DEVICE)
    h = attention_residual(query, sources, weight, backend="triton")
    torch.autograd.grad(h.sum(), [query, *sources])
    for name, args in launches:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        assert tensors and all(t.is_floating_point() for t in tensors), f"{name} got a non-floating tensor"
    names = [name for name, _ in launches]
    assert names.count("attnres_fwd_kernel") == names.count("attnres_dots_kernel") == 4
    assert names.count("attnres_grads_kernel") == 4


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mixed_source_dtypes_are_read_each_in_its_own(monkeypatch, dtype, autocast):
    """Under autocast a model's sources are an fp32 embedding followed by half-precision outputs. The launcher
    checked ``sources[0]`` only and the kernel read every pointer as that dtype (bf16 buffers read as fp32, out of
    bounds: silently wrong on CUDA); then every input was cast to the autocast dtype, rounding the fp32 residual
    stream. Now the compute dtype is the promoted one (fp32), and each pointer argument has its source's own dtype:
    the launches get the caller's fp32 and half tensors (no cast copies), h comes back in fp32, and values and
    gradients are the float64 reference on the unrounded inputs (a bf16 rounding of the fp32 embedding would
    exceed the fp32 tolerance); each source's gradient is in its own dtype. 11 sources: two chained launches, the
    second starting at a half-precision source."""
    launches = record_launches(monkeypatch)
    shape = (2, 9, 24, 11)
    query, sources, weight = make_inputs(shape, torch.float32, DEVICE)
    sources = [sources[0]] + [x.detach().to(dtype).requires_grad_() for x in sources[1:]]
    grad_h, grad_alpha = make_grads(shape, torch.float32, DEVICE)
    with torch.autocast(DEVICE, dtype=dtype, enabled=autocast):
        h = attention_residual(query, sources, weight, backend="triton")
        assert h.dtype == torch.float32
        check_run(query, sources, weight, grad_h, grad_alpha, "triton")
    for name, args in launches:
        pointers = {a.data_ptr(): a.dtype for a in args if isinstance(a, torch.Tensor)}
        for x in sources:
            if x.data_ptr() in pointers:
                assert pointers[x.data_ptr()] == x.dtype, name
    read = {a.data_ptr() for name, args in launches if name == "attnres_fwd_kernel" for a in args[:8]}
    assert {x.data_ptr() for x in sources} <= read  # every source reached the kernel as the caller's tensor
    grads = torch.autograd.grad(attention_residual(query, sources, weight, backend="triton"), sources, grad_h)
    assert [g.dtype for g in grads] == [x.dtype for x in sources]


def test_model_training_under_autocast_on_triton_matches_torch(monkeypatch):
    """The same through the model (what ``Trainer(bf16=True)`` runs): a bf16-autocast training step on the Triton
    backend gives the torch backend's loss and gradients to bf16 rounding (before: the kernel read the bf16
    outputs as fp32), and the residual stream (every AttnRes call's output) stays fp32."""
    from depthfusion_hf.models.modeling_attnres import AttnResForCausalLM
    from tests.attnres.helpers import randomise_attnres, tiny_config

    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=3)).to(DEVICE).train()
    randomise_attnres(model)
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    results, mixed = {}, []
    for module in model.modules():
        if type(module).__name__ == "AttnResMix":
            module.register_forward_hook(lambda mod, args, out: mixed.append(out[0].dtype))
    for backend in ("triton", "torch"):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        results[backend] = loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}
    eps = torch.finfo(torch.bfloat16).eps
    (loss, grads), (want_loss, want_grads) = results["triton"], results["torch"]
    assert abs(loss - want_loss) <= 16 * eps * abs(want_loss)
    for name, g in want_grads.items():
        assert (grads[name] - g).norm() <= 32 * eps * g.norm(), name
    assert mixed and set(mixed) == {torch.float32}


def test_launches_run_under_the_tensors_device():
    """Triton launches on the current CUDA device: tensors on ``cuda:1`` must be launched under a guard for
    ``cuda:1`` (and on its current stream, which the guard makes current), not on ``torch.cuda.current_device()``."""
    guard = attnres_triton._on(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert not isinstance(attnres_triton._on(torch.device("cpu")), torch.cuda.device)
