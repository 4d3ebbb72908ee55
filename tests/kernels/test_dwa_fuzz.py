"""Property-based fuzz of ``depth_weighted_average`` against a float64 evaluation of the definition.

Hypothesis draws the number of sources, the shape (0-d, empty and odd sizes included), the memory
layout (contiguous, transposed, strided slices, stride-0 broadcasts, one stacked [N, *S] tensor), the
states' and weights' dtypes, the magnitude of the inputs and the PyTorch path (list Function or
stacked matrix-vector product); every backend must give the definition's values and gradients within
a bound derived from the dtype's rounding and the inputs' magnitude (see :func:`rounding_bound`).

The Triton backend runs here on CUDA or under ``TRITON_INTERPRET=1``; a plain CPU run checks it with
a few examples in an interpreted child process (:func:`test_fuzz_triton_interpreted`).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from depthfusion_hf.models import dwa
from depthfusion_hf.models.dwa import depth_weighted_average
from tests.kernels.interpret import kernels_run_in_process, needs_child_process, run_interpreted

BACKENDS = ["torch", "reference"] + (["triton"] if kernels_run_in_process() else [])
STATE_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
WEIGHT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, None]  # None: the states' dtype
LAYOUTS = ["contiguous", "transposed", "sliced", "broadcast", "stacked"]
# Interpreted Triton costs ~0.1 s per call: a few examples there, more on the PyTorch paths.
EXAMPLES = {"triton": 12 if os.environ.get("TRITON_INTERPRET") == "1" else 60, "torch": 120, "reference": 60}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Largest relative error of one rounding to ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def subnormal_spacing(dtype: torch.dtype) -> float:
    """Absolute error of one rounding near zero (fp16 inputs of magnitude 1e-3 reach its subnormals)."""
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps


@st.composite
def cases(draw):
    """One fuzz case: a dict with the construction parameters of the states and weights."""
    dtype = draw(st.sampled_from(STATE_DTYPES))
    max_exp = 2 if dtype == torch.float16 else 3  # fp16 overflows (65504) beyond ~1e2 * N * |w| * |x|
    return dict(
        n=draw(st.integers(1, 6)),
        shape=tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3))),
        dtype=dtype,
        weight_dtype=draw(st.sampled_from(WEIGHT_DTYPES)) or dtype,
        layout=draw(st.sampled_from(LAYOUTS)),
        scale=10.0 ** draw(st.integers(-3, max_exp)),
        small_path=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_case(case: dict) -> tuple[torch.Tensor | list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(states argument, leaf sources, leaf weights, grad_out)`` for one drawn case."""
    gen = torch.Generator().manual_seed(case["seed"])
    n, shape, dtype, layout = case["n"], case["shape"], case["dtype"], case["layout"]

    def randn(*size):
        return (torch.randn(size, generator=gen, dtype=torch.float64) * case["scale"]).to(dtype)

    if layout == "stacked":
        stacked = randn(n, *shape).requires_grad_(True)
        states, sources = stacked, list(stacked.unbind(0))
        leaves = [stacked]
    else:
        sources = []
        for _ in range(n):
            if layout == "transposed" and len(shape) >= 2:
                x = randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
            elif layout == "sliced" and len(shape) >= 1:
                x = randn(*shape[:-1], 2 * shape[-1] + 1)[..., 1::2]
            elif layout == "broadcast" and len(shape) >= 1:
                x = randn(*shape[:-1], 1).expand(shape)  # stride 0 in the last dimension
            else:
                x = randn(*shape)
            sources.append(x.detach().requires_grad_(True))
        states, leaves = sources, sources
    weights = (torch.randn(n, generator=gen, dtype=torch.float64) * 1.5).to(case["weight_dtype"]).requires_grad_(True)
    grad_out = randn(*shape)
    return states, leaves, weights, grad_out


def rounding_bound(backend: str, sources, weights, grad_out) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Worst-case error bounds (float64, elementwise) of ``y``, each ``dx_n`` and ``dw``.

    Every path computes in the promoted dtype of the states and weights (the output's dtype) and accumulates in
    fp32 (float64 for float64): each weight and source converts exactly, each product and each of the N - 1
    (output) or M - 1 (weight gradient) partial sums is rounded at most once in the accumulation dtype, and the
    result once to its dtype (a source gradient ``w_n g`` to the source's dtype, ``dw`` to the weights'); each
    rounding's error is at most the unit roundoff times the magnitude of the rounded value, which is at most
    the sum of the magnitudes of its terms. ``backend`` does not change the bound.
    """
    n = len(sources)
    out_dtype = torch.promote_types(sources[0].dtype, weights.dtype)
    acc_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    u_out, u_acc = unit_roundoff(out_dtype), unit_roundoff(acc_dtype)
    u_x, u_w = unit_roundoff(sources[0].dtype), unit_roundoff(weights.dtype)
    xs = [x.detach().double() for x in sources]
    w = weights.detach().double()
    g = grad_out.double()
    terms = sum(w[i].abs() * xs[i].abs() for i in range(n))  # sum_n |w_n x_n|, elementwise
    bound_y = (n + 2) * u_acc * terms + u_out * terms + (n + 2) * subnormal_spacing(out_dtype)
    bound_dx = [(u_x + 2 * u_acc) * (w[i] * g).abs() + 2 * subnormal_spacing(sources[0].dtype) for i in range(n)]
    m = max(g.numel(), 1)
    dot_terms = torch.stack([(g * x).abs().sum() for x in xs]) if g.numel() else torch.zeros(n, dtype=torch.float64)
    bound_dw = (m + 2) * u_acc * dot_terms + u_w * dot_terms + m * subnormal_spacing(weights.dtype)
    return bound_y, bound_dx, bound_dw


def assert_within(name: str, actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    """``|actual - expected| <= 2 * bound`` elementwise (2: margin for the bound's own first-order terms)."""
    err = (actual.detach().double() - expected).abs()
    excess = err - 2 * bound
    assert bool((excess <= 0).all()), (
        f"{name}: error {err.max().item():.3g} exceeds the rounding bound (worst excess {excess.max().item():.3g})"
    )


def check_case(backend: str, case: dict) -> None:
    states, leaves, weights, grad_out = make_case(case)
    sources = list(states.unbind(0)) if isinstance(states, torch.Tensor) else states
    saved = dwa.SMALL_NUMEL
    dwa.SMALL_NUMEL = 1 << 40 if case["small_path"] else -1
    try:
        y = depth_weighted_average(states, weights, backend=backend)
    finally:
        dwa.SMALL_NUMEL = saved
    assert y.shape == sources[0].shape and y.dtype == torch.promote_types(case["dtype"], weights.dtype)
    grads = torch.autograd.grad(y, [weights, *leaves], grad_out.to(y.dtype), allow_unused=False)
    dw, *dleaves = grads
    dxs = list(dleaves[0].unbind(0)) if case["layout"] == "stacked" else dleaves
    assert dw.dtype == weights.dtype and dw.shape == weights.shape

    # The definition in float64 on the same (already rounded) input values.
    xs64 = [x.detach().double() for x in sources]
    w64 = weights.detach().double()
    g64 = grad_out.to(y.dtype).double()
    y_ref = sum(w64[i] * xs64[i] for i in range(len(xs64)))
    dw_ref = torch.stack([(g64 * x).sum() for x in xs64])
    bound_y, bound_dx, bound_dw = rounding_bound(backend, sources, weights, grad_out)
    assert_within("output", y, y_ref, bound_y)
    assert_within("weight gradient", dw, dw_ref, bound_dw)
    for i, dx in enumerate(dxs):
        assert dx.shape == sources[i].shape and dx.dtype == case["dtype"]
        assert_within(f"gradient of source {i}", dx, w64[i] * g64, bound_dx[i])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_values_and_gradients(backend):
    """Values and first-order gradients of every backend stay within the rounding bound of the definition."""

    @settings(max_examples=EXAMPLES[backend], deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases())
    def run(case):
        check_case(backend, case)

    run()


@pytest.mark.integration
@pytest.mark.skipif(not needs_child_process(), reason="Triton already fuzzed in this process (CUDA/interpreted)")
def test_fuzz_triton_interpreted():
    out = run_interpreted(__file__, extra_args=("-k", "test_fuzz_values_and_gradients and triton"))
    assert "1 passed" in out.splitlines()[-1], out[-2000:]
