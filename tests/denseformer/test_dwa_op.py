"""depth_weighted_average: every PyTorch backend against the paper's loop, values and gradients."""

import pytest
import torch

from depthfusion_hf.models.dwa import dwa_reference, resolve_backend
from depthfusion_hf.ops import depth_weighted_average


def _relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).pow(2).mean().sqrt() / (b.double().pow(2).mean().sqrt() + 1e-12)).item()


# The torch path accumulates in fp32 and rounds each output element (and each source gradient
# w[n] * g) once to the states' dtype: a relative error of at most u (the dtype's unit roundoff), so a
# rel-RMS of at most u, plus fp32 accumulation (N terms: N * 2^-24 of the terms' magnitude, which
# cancellation in a sum of random terms inflates by at most ~sqrt(N)). The weight gradient is an fp32
# dot product over M = prod(S) terms of exact products (~sqrt(M) * 2^-24 relative, bounded by 1e-5),
# rounded once to the weights' dtype (the states' here, so that the output keeps that dtype).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,shape", [(1, (3,)), (2, (5, 7)), (7, (2, 15, 33)), (13, (1, 63, 10))])
@pytest.mark.parametrize("as_stack", [False, True])
def test_torch_matches_reference(dtype, n, shape, as_stack):
    states = [torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(n)]
    weights = torch.randn(n, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape, dtype=dtype)

    leaves64 = [t.detach().double().requires_grad_(True) for t in [*states, weights]]
    ref = dwa_reference(leaves64[:-1], leaves64[-1], torch.float64)
    ref_grads = torch.autograd.grad(ref, leaves64, grad.double())

    inp = torch.stack(states) if as_stack else states
    out = depth_weighted_average(inp, weights, backend="torch")
    assert out.shape == shape and out.dtype == dtype
    grads = torch.autograd.grad(out, [*states, weights], grad)

    u = torch.finfo(dtype).eps / 2
    tol = u + 4 * n**1.5 * 2.0**-24
    assert _relative_rms(out, ref) <= tol
    for g, r in zip(grads[:-1], ref_grads[:-1]):
        assert g.shape == r.shape
        assert _relative_rms(g, r) <= tol
    assert _relative_rms(grads[-1], ref_grads[-1]) <= 1e-5 + (u if dtype != torch.float32 else 0.0)


def test_reference_is_the_loop():
    states = torch.randn(4, 3, 2)
    weights = torch.tensor([0.5, -1.0, 2.0, 0.0])
    expected = 0.5 * states[0] - states[1] + 2 * states[2]
    torch.testing.assert_close(depth_weighted_average(states, weights, backend="reference"), expected)
    torch.testing.assert_close(depth_weighted_average(states, weights, backend="torch"), expected)


def test_gradcheck_float64():
    states = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    weights = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w, *s: depth_weighted_average(list(s), w, backend="torch"),
                                    (weights, *states))


def test_partial_requires_grad():
    states = [torch.randn(4, 5), torch.randn(4, 5, requires_grad=True)]
    weights = torch.randn(2)
    out = depth_weighted_average(states, weights, backend="torch")
    (g,) = torch.autograd.grad(out.sum(), [states[1]])
    torch.testing.assert_close(g, torch.full((4, 5), weights[1].item()))


@pytest.mark.parametrize(
    "states,weights,match",
    [
        ([torch.zeros(2), torch.zeros(3)], torch.zeros(2), r"share shape and device.*states\[1\] is \(3,\)"),
        ([torch.zeros(2), torch.zeros(2)], torch.zeros(3), r"weights must have shape \[N\]"),
        ([], torch.zeros(0), "at least one"),
        ([torch.zeros(2)], torch.zeros(1, dtype=torch.long), "floating-point"),
        # Integer, bool and complex tensors: every path used to return zeros or garbage; rejected now.
        ([torch.ones(3, dtype=torch.long)] * 2, torch.ones(2), "states must have a floating-point dtype.*int64"),
        ([torch.ones(3, dtype=torch.int32)], torch.ones(1), "floating-point dtype.*int32"),
        ([torch.ones(3, dtype=torch.bool)], torch.ones(1), "floating-point dtype.*bool"),
        ([torch.ones(3, dtype=torch.uint8)], torch.ones(1), "floating-point dtype.*uint8"),
        ([torch.ones(3, dtype=torch.complex64)], torch.ones(1), "floating-point dtype.*complex64"),
        ([torch.ones(3).to(torch.float8_e4m3fn)], torch.ones(1), "floating-point dtype.*float8"),
        ([torch.ones(3)], torch.ones(1, dtype=torch.bool), "weights must be a floating-point"),
        ([torch.ones(3)], torch.ones(1, dtype=torch.complex64), "weights must be a floating-point"),
        ([torch.ones(3)], torch.ones(1, device="meta"), "weights must be on the states' device cpu"),
        ([torch.ones(3), 2.0], torch.ones(2), r"states\[1\] is <class 'float'>"),
        ([torch.ones(3)], [1.0], "weights must be a tensor"),
        (torch.tensor(1.0), torch.ones(1), "0-d tensor"),
        (torch.zeros(0, 3), torch.zeros(0), "at least one"),
    ],
)
def test_bad_input(states, weights, match):
    with pytest.raises(ValueError, match=match):
        depth_weighted_average(states, weights)


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend(None, cpu) == "torch"
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
    assert resolve_backend(None, cpu) == "reference"
    assert resolve_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda-magic", cpu)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize(
    "state_dtypes,weight_dtype,autocast,expected",
    [
        ([torch.float32, torch.float32], torch.float32, None, torch.float32),
        ([torch.bfloat16, torch.bfloat16], torch.bfloat16, None, torch.bfloat16),
        ([torch.bfloat16, torch.bfloat16], torch.float32, None, torch.float32),  # promoted with the weights
        ([torch.float32, torch.bfloat16], torch.bfloat16, None, torch.float32),
        ([torch.float16, torch.bfloat16], torch.float16, None, torch.float32),  # promote_types(fp16, bf16)
        # Autocast does not lower the sum (a residual stream: a Llama's x + f(x) stays fp32 under autocast).
        ([torch.float32, torch.float32], torch.float32, torch.bfloat16, torch.float32),
        ([torch.float32, torch.bfloat16], torch.float32, torch.bfloat16, torch.float32),
        ([torch.bfloat16, torch.bfloat16], torch.bfloat16, torch.bfloat16, torch.bfloat16),
        ([torch.float32, torch.bfloat16], torch.float32, torch.float16, torch.float32),
        ([torch.float64, torch.float32], torch.float32, torch.bfloat16, torch.float64),
    ],
)
def test_one_compute_dtype_for_every_backend(backend, state_dtypes, weight_dtype, autocast, expected):
    """The dispatcher decides the dtype (the promoted one, also under autocast) for every backend; the sum
    is accumulated in fp32 and rounded once to it, each gradient comes back in its input's dtype."""
    gen = torch.Generator().manual_seed(0)
    states = [torch.randn(3, 40, generator=gen).to(d).requires_grad_(True) for d in state_dtypes]
    weights = torch.randn(len(states), generator=gen).to(weight_dtype).requires_grad_(True)
    context = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        out = depth_weighted_average(states, weights, backend=backend)
    assert out.dtype == expected
    exact = sum(w.double() * x.double() for w, x in zip(weights.detach(), states))
    # One rounding to the output dtype (and fp32 accumulation): within a unit roundoff of each element, plus
    # the fp32 sum's own error.
    u = torch.finfo(expected).eps / 2
    terms = sum((w.double() * x.double()).abs() for w, x in zip(weights.detach(), states))
    assert bool(((out.double() - exact).abs() <= u * exact.abs() + 4 * 2.0**-24 * terms).all())
    grads = torch.autograd.grad(out, [weights, *states], torch.ones_like(out))
    assert [g.dtype for g in grads] == [weight_dtype, *state_dtypes]


def test_meta_device_sizes_without_autocast_queries():
    """Autocast cannot be asked about the meta device: the op still sizes its output there."""
    out = depth_weighted_average([torch.empty(2, 3, device="meta")] * 2, torch.empty(2, device="meta"),
                                 backend="torch")
    assert out.device.type == "meta" and out.shape == (2, 3) and out.dtype == torch.float32
