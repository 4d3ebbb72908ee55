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

from depthfusion_hf.models.attnres import attnres, attnres_triton  # noqa: E402
from depthfusion_hf.models.attnres.attnres import attention_residual  # noqa: E402
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
    assert attnres_triton.attnres_triton_available()
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
        attnres_triton.triton_attention_residual(query, sources, weight, 1e-6)
    with pytest.raises(ValueError, match="needs sources of one dtype"):  # the kernel reads every pointer as one
        attnres_triton.triton_attention_residual(query.float(), [sources[0].float(), sources[1].bfloat16()],
                                                 weight.float(), 1e-6)


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
