"""Shared inputs, float64 ground truth and dtype-scaled comparisons for the ``attention_residual`` tests.

Used by ``tests/attnres/test_attnres_op.py`` (reference and torch backends) and
``tests/kernels/test_attnres_triton.py`` (the fused kernel, interpreted or on CUDA).
"""

from __future__ import annotations

import functools

import torch

from depthfusion_hf.models.attnres import attention_residual, attnres_reference

# (B, T, D, N): T = 1, 15, 63; D not a power of two (and D = 1); N = 1 and N = 25.
SHAPES = [
    (1, 1, 8, 1),
    (2, 15, 24, 3),
    (1, 63, 20, 25),
    (3, 5, 33, 2),
    (2, 63, 48, 4),
    (1, 15, 3, 5),
    (1, 15, 1, 5),
]


def shape_id(shape: tuple[int, int, int, int]) -> str:
    """Readable pytest id for a (B, T, D, N) case."""
    return "B{}-T{}-D{}-N{}".format(*shape)


def make_inputs(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: str = "cpu",
    *,
    seed: int = 0,
    query_scale: float = 2.0,
    non_contiguous: bool | str = False,
    param_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """``(query [D], sources N x [B, T, D], key_norm_weight [D])``, all leaves requiring grad; the query and
    key-norm weight in ``param_dtype`` (default: the sources' dtype, so that it is the compute dtype).

    Sources have different magnitudes (so their norms differ); the logits have a standard deviation
    of about ``query_scale`` (2: a clearly non-uniform softmax). ``non_contiguous``: False or
    ``"contiguous"``; True or ``"transposed"`` (views of [B, D, T] storage); ``"strided"`` (every other
    element along D of a [B, T, 2D] tensor).
    """
    batch, seq, dim, n_src = shape
    gen = torch.Generator().manual_seed(seed)
    query = (query_scale * torch.randn(dim, generator=gen, dtype=torch.float64) / dim**0.5)
    weight = 1.0 + 0.5 * torch.randn(dim, generator=gen, dtype=torch.float64)
    sources = []
    for i in range(n_src):
        scale = 0.5 + 2.5 * i / max(n_src - 1, 1)
        x = scale * torch.randn(batch, dim, seq, generator=gen, dtype=torch.float64)
        x = x.to(device, dtype)
        if non_contiguous == "strided":
            wide = torch.zeros(batch, seq, 2 * dim, device=device, dtype=dtype)
            wide[..., ::2] = x.transpose(1, 2)
            x = wide[..., ::2]
        elif non_contiguous in (True, "transposed"):
            x = x.transpose(1, 2)
        else:
            x = x.transpose(1, 2).contiguous()
        sources.append(x.requires_grad_())
    query = query.to(device, param_dtype or dtype).requires_grad_()
    weight = weight.to(device, param_dtype or dtype).requires_grad_()
    return query, sources, weight


def make_grads(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str = "cpu", seed: int = 1):
    """``(grad_h [B, T, D] in dtype, grad_alpha [B, T, N] float32)``."""
    batch, seq, dim, n_src = shape
    gen = torch.Generator().manual_seed(seed)
    grad_h = torch.randn(batch, seq, dim, generator=gen).to(device, dtype)
    grad_alpha = torch.randn(batch, seq, n_src, generator=gen).to(device)
    return grad_h, grad_alpha


def compute_dtype(query, sources, weight) -> torch.dtype:
    """The op's compute dtype: the promoted dtype of the inputs (also under autocast)."""
    return functools.reduce(torch.promote_types, [query.dtype, weight.dtype, *(x.dtype for x in sources)])


def run_op(query, sources, weight, grad_h, grad_alpha, backend, **kwargs):
    """Forward with ``return_weights`` and the gradients of ``<h, grad_h> + <alpha, grad_alpha>``.

    Returns ``(h, alpha, [d_query, d_weight, *d_sources])``.
    """
    h, alpha = attention_residual(query, sources, weight, return_weights=True, backend=backend, **kwargs)
    outs, grads = [h], [grad_h.to(h.dtype)]
    if grad_alpha is not None:
        outs.append(alpha)
        grads.append(grad_alpha.to(alpha.dtype))
    return h, alpha, list(torch.autograd.grad(outs, [query, weight, *sources], grads))


def truth(query, sources, weight, grad_h, grad_alpha, eps: float = 1e-6):
    """The reference evaluated in float64 on the same inputs (each converts to the compute dtype exactly):
    ``(h, alpha, grads)``."""
    dtype = compute_dtype(query, sources, weight)
    q = query.detach().to(dtype).double().requires_grad_()
    g = weight.detach().to(dtype).double().requires_grad_()
    xs = [x.detach().to(dtype).double().requires_grad_() for x in sources]
    with torch.autocast(sources[0].device.type, enabled=False):
        h, alpha = attnres_reference(q, xs, g, eps)
    outs, grads = [h], [grad_h.double()]
    if grad_alpha is not None:
        outs.append(alpha)
        grads.append(grad_alpha.double())
    return h, alpha, list(torch.autograd.grad(outs, [q, g, *xs], grads))


def eps_of(dtype: torch.dtype) -> float:
    """Machine epsilon of ``dtype`` (2^-23 for fp32, 2^-7 for bf16)."""
    return torch.finfo(dtype).eps


def error_scales(query, sources, weight, grad_h, grad_alpha, eps: float = 1e-6) -> dict[str, list[torch.Tensor]]:
    """Elementwise float64 magnitudes of the terms each output is computed from (rounding-error scales).

    A sum, dot product or softmax computed in a precision with unit roundoff ``e`` has an error of
    order ``e`` times the sum of the absolute values of its terms, not times its result: outputs that
    cancel (a small query gradient, D = 1 where ``1 - v^2 / (v^2 + eps)`` cancels) are checked against
    the size of what cancelled. Per token, with ``L_i = r_i (|u| . |v_i|)`` the logit's term size and
    ``A_i = |dh| . |v_i| + |dalpha_i|`` the weight gradient's:

        alpha_i: a_i = alpha_i (1 + L_i + sum_j alpha_j L_j)        h: sum_i a_i |v_i|
        ds_i:    c_i = a_i (A_i + sum_j a_j A_j)                     dv_i: a_i |dh| + c_i r_i (|u| + L_i r_i |v_i| / D)
        du:      sum_tokens sum_i c_i r_i |v_i|;  dw = du |g|, dg = du |w|

    Returns ``{"h": [..], "alpha": [..], "grads": [d_query, d_weight, *d_sources]}`` scales.
    """
    dtype = compute_dtype(query, sources, weight)
    query, weight, sources = query.to(dtype), weight.to(dtype), [x.to(dtype) for x in sources]
    w, g = query.detach().double(), weight.detach().double()
    xs = [x.detach().double().abs() for x in sources]
    dim = xs[0].shape[-1]
    u = (w * g).abs()
    r = torch.stack([torch.rsqrt(x.pow(2).mean(-1) + eps) for x in xs], -1)  # [B, T, N]
    logit_terms = torch.stack([x @ u for x in xs], -1) * r
    _, alpha = attnres_reference(w, [x.detach().double() for x in sources], g, eps)
    a = alpha * (1 + logit_terms + (alpha * logit_terms).sum(-1, keepdim=True))
    dh = grad_h.detach().double().abs()
    big_a = torch.stack([(dh * x).sum(-1) for x in xs], -1)
    if grad_alpha is not None:
        big_a = big_a + grad_alpha.detach().double().abs()
    c = a * (big_a + (a * big_a).sum(-1, keepdim=True))
    h = sum(a[..., i : i + 1] * x for i, x in enumerate(xs))
    dv = [a[..., i : i + 1] * dh + (c[..., i] * r[..., i]).unsqueeze(-1)
          * (u + (logit_terms[..., i] * r[..., i]).unsqueeze(-1) * x / dim) for i, x in enumerate(xs)]
    du = sum((c[..., i] * r[..., i]).unsqueeze(-1) * x for i, x in enumerate(xs)).reshape(-1, dim).sum(0)
    return {"h": [h], "alpha": [a], "grads": [du * g.abs(), du * w.abs(), *dv]}


def assert_scaled_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, k: float, what: str,
    scale: torch.Tensor | None = None, rounded_to: torch.dtype | None = None,
) -> None:
    """``|actual - expected| <= k * eps(dtype) * scale (+ eps(rounded_to) * |expected|)`` elementwise, in float64.

    ``scale`` defaults to ``max|expected|``; ``rounded_to`` adds one rounding of the result to a half type
    (relative, plus the subnormal spacing).
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    if e.numel() == 0:
        return
    scale = torch.full_like(e, e.abs().max().item()) if scale is None else scale.double().cpu()
    tol = k * eps_of(dtype) * scale
    if rounded_to is not None:  # one rounding: relative, or the subnormal spacing (fp16 gradients underflow)
        info = torch.finfo(rounded_to)
        tol = tol + info.eps * e.abs() + info.smallest_normal * info.eps
    excess = ((a - e).abs() - tol).max().item()
    if excess > 0:
        worst = int(((a - e).abs() - tol).argmax())
        raise AssertionError(
            f"{what}: error {(a - e).abs().flatten()[worst]:.3e} > tolerance {tol.flatten()[worst]:.3e} at flat index "
            f"{worst} (k={k}, eps={eps_of(dtype):.1e}, term scale {scale.flatten()[worst]:.3e}, "
            f"value {e.flatten()[worst]:.3e})"
        )


# Tolerance factor for the fp32 arithmetic, in units of eps(fp32) times the term scales of
# :func:`error_scales`. Half-type values and source gradients add one rounding to their dtype (covers
# round-to-nearest and the interpreter's truncating cast).
K_FP32 = 4


def check_against_truth(result, expected, dtype: torch.dtype, scales: dict[str, list[torch.Tensor]]) -> None:
    """Compare ``(h, alpha, grads)`` of a path run in the compute dtype ``dtype`` with :func:`truth`."""
    h, alpha, grads = result
    h64, alpha64, grads64 = expected
    half = dtype if dtype in (torch.bfloat16, torch.float16) else None
    arithmetic = torch.float64 if dtype == torch.float64 else torch.float32
    assert h.dtype == dtype and alpha.dtype == arithmetic
    assert_scaled_close(h, h64, arithmetic, K_FP32, "h", scales["h"][0], half)
    assert_scaled_close(alpha, alpha64, arithmetic, K_FP32, "alpha", scales["alpha"][0])
    names = ["d_query", "d_key_norm_weight"] + [f"d_sources[{i}]" for i in range(len(grads) - 2)]
    for i, (a, e, sc) in enumerate(zip(grads, grads64, scales["grads"])):
        # a gradient in a dtype coarser than the arithmetic (an input cast to the compute dtype) is rounded to it
        rounded = a.dtype if torch.finfo(a.dtype).eps > eps_of(arithmetic) else half
        assert_scaled_close(a, e, arithmetic, K_FP32, names[i], sc, rounded)


def check_run(query, sources, weight, grad_h, grad_alpha, backend) -> None:
    """Run ``backend`` on these inputs and compare everything with the float64 truth (in the compute dtype)."""
    result = run_op(query, sources, weight, grad_h, grad_alpha, backend)
    expected = truth(query, sources, weight, grad_h, grad_alpha)
    check_against_truth(result, expected, compute_dtype(query, sources, weight),
                        error_scales(query, sources, weight, grad_h, grad_alpha))


def run_and_check(shape, dtype, backend, device="cpu", **make_kwargs) -> None:
    """One full comparison of ``backend`` with the float64 truth (values, weights, all gradients)."""
    query, sources, weight = make_inputs(shape, dtype, device, **make_kwargs)
    grad_h, grad_alpha = make_grads(shape, dtype, device)
    check_run(query, sources, weight, grad_h, grad_alpha, backend)
