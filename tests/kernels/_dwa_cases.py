"""Shared inputs and comparison helpers for the DWA tests (the reference is computed in float64)."""

from __future__ import annotations

import torch

from depthfusion_hf.models.dwa import dwa_reference

# (N, S): N = 1, 2, 7; S with non-power-of-two sizes, a single element, and an empty one.
SHAPES = [
    (1, (3, 5, 37)),
    (2, (3, 5, 37)),
    (7, (3, 5, 37)),
    (7, (1,)),
    (2, (2, 129)),
    (3, (0, 4)),
]

# Relative-RMS tolerances (fla style) per dtype: outputs are rounded to the dtype once.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.2e-2, torch.float16: 2e-3, torch.float64: 1e-12}


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``rms(actual - expected) / rms(expected)`` in float64 (0 for empty tensors)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if e.numel() == 0:
        return 0.0
    return ((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_inputs(n: int, shape: tuple[int, ...], dtype: torch.dtype, device: str, non_contiguous: bool = False,
                seed: int = 0, weight_dtype: torch.dtype | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """N leaf sources of ``shape`` (strided views when ``non_contiguous``) and [N] leaf weights (in the states'
    dtype unless ``weight_dtype``: the op's output then has the states' dtype)."""
    gen = torch.Generator().manual_seed(seed)
    sources = []
    for _ in range(n):
        if non_contiguous and len(shape) >= 2:
            # A transposed view: same shape, non-contiguous memory.
            x = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=gen).to(device, dtype).transpose(-1, -2)
        elif non_contiguous:
            x = torch.randn(shape[0] * 2, *shape[1:], generator=gen).to(device, dtype)[::2]
        else:
            x = torch.randn(*shape, generator=gen).to(device, dtype)
        sources.append(x.detach().requires_grad_(True))
    weights = torch.randn(n, generator=gen).to(device, weight_dtype or dtype).requires_grad_(True)
    return sources, weights


def reference_with_grads(sources: list[torch.Tensor], weights: torch.Tensor, grad_out: torch.Tensor):
    """float64 reference ``(y, dw, [dx_n])`` for the same input values (the paper's loop)."""
    xs = [x.detach().double().requires_grad_(True) for x in sources]
    w = weights.detach().double().requires_grad_(True)
    y = dwa_reference(xs, w, torch.float64)
    dw, *dxs = torch.autograd.grad(y, [w, *xs], grad_out.double())
    return y, dw, dxs


def weight_grad_tol(dtype: torch.dtype) -> float:
    """dw sums products of exact values in fp32: fp32-tight, then rounded once to the weights' dtype."""
    return 1e-5 + (torch.finfo(dtype).eps / 2 if dtype in (torch.float16, torch.bfloat16) else 0.0)


def assert_matches_reference(y, grads, sources, weights, grad_out) -> None:
    """Compare a backend's output ``y`` and gradients ``(dw, *dxs)`` with the float64 reference.

    The output has the promoted dtype of the states and weights (the op's compute dtype outside autocast).
    """
    dtype = sources[0].dtype
    out_dtype = torch.promote_types(dtype, weights.dtype)
    y_ref, dw_ref, dxs_ref = reference_with_grads(sources, weights, grad_out)
    tol = TOL[out_dtype]
    assert y.dtype == out_dtype and y.shape == sources[0].shape and y.device == sources[0].device
    assert rel_rms(y, y_ref) <= tol, f"output rel-RMS {rel_rms(y, y_ref):.3g} > {tol}"
    dw, *dxs = grads
    assert dw.dtype == weights.dtype and dw.shape == weights.shape
    assert rel_rms(dw, dw_ref) <= weight_grad_tol(weights.dtype), f"weight grad rel-RMS {rel_rms(dw, dw_ref):.3g}"
    tol = TOL[dtype]
    assert len(dxs) == len(sources)
    for n, (dx, dx_ref) in enumerate(zip(dxs, dxs_ref)):
        assert dx.dtype == dtype and dx.shape == sources[n].shape
        assert rel_rms(dx, dx_ref) <= tol, f"grad of source {n}: rel-RMS {rel_rms(dx, dx_ref):.3g} > {tol}"


# (depth d, dilation k, period p) of simulated DenseFormers.
CHAINS = [(6, 1, 1), (12, 4, 5), (7, 2, 3)]


def dense_chain_loss(depth: int, dilation: int, period: int, x0: torch.Tensor, scales: torch.Tensor,
                     alphas: torch.Tensor, step_fn) -> torch.Tensor:
    """A k×p DenseFormer with blocks ``X_i = tanh(Y_{i-1}) * scales[i - 1]``; ``step_fn(sources, ids, w)``: DWA."""
    outputs = {0: x0}
    x, offset = x0, 0
    for i in range(1, depth + 1):
        x = torch.tanh(x) * scales[i - 1]
        outputs[i] = x
        if i % period == 0:
            ids = list(range(i % dilation, i + 1, dilation))
            x = step_fn([outputs[j] for j in ids], ids, alphas[offset : offset + len(ids)])
            offset += len(ids)
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    return x.square().mean()


def chain_inputs(depth: int, dilation: int, period: int, dtype: torch.dtype, device: str, shape=(3, 50)):
    """Leaf ``x0`` [*shape], ``scales`` [depth] and packed ``alphas`` for :func:`dense_chain_loss`."""
    gen = torch.Generator().manual_seed(depth * 100 + dilation * 10 + period)
    n_alpha = sum(len(range(i % dilation, i + 1, dilation)) for i in range(1, depth + 1) if i % period == 0)
    x0 = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_(True)
    scales = (1 + 0.1 * torch.randn(depth, generator=gen)).to(device, dtype).requires_grad_(True)
    alphas = torch.randn(n_alpha, generator=gen).to(device, dtype).requires_grad_(True)
    return x0, scales, alphas


def second_order_grads(dwa_fn, sources, weights, grad_out, c, rs):
    """Second-order gradients through a DWA's backward (what ``create_graph=True`` users get).

    With ``(dw, dx_n)`` the first-order gradients for the output gradient ``g`` (built with
    ``create_graph=True``), returns the gradients of ``z = <c, dw> + sum_n <r_n, dx_n>`` with respect
    to ``(weights, *sources, g)``; the definition gives ``<r_m, g>``, ``c_m g`` and
    ``sum_n c_n x_n + w_n r_n``.
    """
    g = grad_out.detach().clone().requires_grad_(True)
    y = dwa_fn(sources, weights)
    dw, *dxs = torch.autograd.grad(y, [weights, *sources], g, create_graph=True)
    z = (c.to(dw) * dw).sum() + sum((r * dx).double().sum() for r, dx in zip(rs, dxs))
    return torch.autograd.grad(z, [weights, *sources, g])


def assert_second_order_matches_reference(dwa_fn, dtype: torch.dtype, device: str, tol: float) -> None:
    """:func:`second_order_grads` of ``dwa_fn`` against the paper's loop in float64, to ``tol`` (rel-RMS)."""
    sources, weights = make_inputs(4, (3, 37), dtype, device, seed=3)
    gen = torch.Generator().manual_seed(4)
    grad_out = torch.randn(3, 37, generator=gen).to(device, dtype)
    c = torch.randn(4, generator=gen).to(device, weights.dtype)
    rs = [torch.randn(3, 37, generator=gen).to(device, dtype) for _ in range(4)]
    got = second_order_grads(dwa_fn, sources, weights, grad_out, c, rs)
    xs64 = [x.detach().double().requires_grad_(True) for x in sources]
    w64 = weights.detach().double().requires_grad_(True)
    expected = second_order_grads(lambda s, w: dwa_reference(s, w, torch.float64), xs64, w64, grad_out.double(),
                                  c.double(), [r.double() for r in rs])
    names = ["weights", *[f"source {n}" for n in range(4)], "grad_out"]
    for name, a, e in zip(names, got, expected):
        assert a is not None and a.shape == e.shape, name
        assert rel_rms(a, e) <= tol, f"second-order gradient of {name}: rel-RMS {rel_rms(a, e):.3g} > {tol}"
