"""Shared inputs, float64 ground truth and dtype-scaled comparisons for the ``attention_residual`` tests.

Used by ``tests/attnres/test_attnres_op.py`` (reference and torch backends) and
``tests/kernels/test_attnres_triton.py`` (the fused kernel, interpreted or on CUDA).
"""

from __future__ import annotations

import torch

from depthfusion_hf.models.attnres.attnres import attention_residual, attnres_reference

# (B, T, D, N): T = 1, 15, 63; D not a power of two; N = 1 and N = 25.
SHAPES = [
    (1, 1, 8, 1),
    (2, 15, 24, 3),
    (1, 63, 20, 25),
    (3, 5, 33, 2),
    (2, 63, 48, 4),
    (1, 15, 3, 5),
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
    non_contiguous: bool = False,
    param_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """``(query [D], sources N x [B, T, D], key_norm_weight [D])``, all leaves requiring grad.

    Sources have different magnitudes (so their norms differ); the logits have a standard deviation
    of about ``query_scale`` (2: a clearly non-uniform softmax). ``non_contiguous`` builds every
    source as a transposed view ([B, D, T] storage).
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
        x = x.transpose(1, 2) if non_contiguous else x.transpose(1, 2).contiguous()
        sources.append(x.requires_grad_())
    query = query.to(device, param_dtype).requires_grad_()
    weight = weight.to(device, param_dtype).requires_grad_()
    return query, sources, weight


def make_grads(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str = "cpu", seed: int = 1):
    """``(grad_h [B, T, D] in dtype, grad_alpha [B, T, N] float32)``."""
    batch, seq, dim, n_src = shape
    gen = torch.Generator().manual_seed(seed)
    grad_h = torch.randn(batch, seq, dim, generator=gen).to(device, dtype)
    grad_alpha = torch.randn(batch, seq, n_src, generator=gen).to(device)
    return grad_h, grad_alpha


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
    """The reference evaluated in float64 on the same (possibly rounded) inputs: ``(h, alpha, grads)``."""
    q = query.detach().double().requires_grad_()
    g = weight.detach().double().requires_grad_()
    xs = [x.detach().double().requires_grad_() for x in sources]
    h, alpha = attnres_reference(q, xs, g, eps)
    outs, grads = [h], [grad_h.double()]
    if grad_alpha is not None:
        outs.append(alpha)
        grads.append(grad_alpha.double())
    return h, alpha, list(torch.autograd.grad(outs, [q, g, *xs], grads))


def eps_of(dtype: torch.dtype) -> float:
    """Machine epsilon of ``dtype`` (2^-23 for fp32, 2^-7 for bf16)."""
    return torch.finfo(dtype).eps


def assert_scaled_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, k: float, what: str) -> None:
    """``max|actual - expected| <= k * eps(dtype) * max|expected|`` (float64 comparison).

    ``dtype`` is the precision the value was computed or rounded in; ``k`` counts roundings.
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    if e.numel() == 0:
        return
    scale = max(e.abs().max().item(), 1e-30)
    err = (a - e).abs().max().item()
    tol = k * eps_of(dtype) * scale
    assert err <= tol, f"{what}: max error {err:.3e} > {tol:.3e} (k={k}, eps={eps_of(dtype):.1e}, scale {scale:.3e})"


# Tolerance factors, in units of eps(dtype) * max|expected|. fp32: the op's own arithmetic (sums over D,
# N and tokens); half types: values and source gradients are rounded once to the dtype (k = 1 covers
# round-to-nearest and the interpreter's truncating cast), while the logits, weights and the query /
# norm-weight gradients are computed in fp32 from the rounded inputs (k in units of fp32 eps).
K_FP32 = 32
K_HALF_ROUNDED = 1.0


def check_against_truth(result, expected, dtype: torch.dtype) -> None:
    """Compare ``(h, alpha, grads)`` of a path run in ``dtype`` with :func:`truth` on the same inputs."""
    h, alpha, grads = result
    h64, alpha64, grads64 = expected
    rounded = torch.float32 if dtype == torch.float32 else dtype
    k_rounded = K_FP32 if dtype == torch.float32 else K_HALF_ROUNDED
    assert h.dtype == dtype and alpha.dtype == torch.float32
    assert_scaled_close(h, h64, rounded, k_rounded, "h")
    assert_scaled_close(alpha, alpha64, torch.float32, K_FP32, "alpha")
    assert_scaled_close(grads[0], grads64[0], torch.float32, K_FP32, "d_query")
    assert_scaled_close(grads[1], grads64[1], torch.float32, K_FP32, "d_key_norm_weight")
    for i, (a, e) in enumerate(zip(grads[2:], grads64[2:])):
        assert a.dtype == dtype
        assert_scaled_close(a, e, rounded, k_rounded, f"d_sources[{i}]")


def run_and_check(shape, dtype, backend, device="cpu", **make_kwargs) -> None:
    """One full comparison of ``backend`` with the float64 truth (values, weights, all gradients)."""
    query, sources, weight = make_inputs(shape, dtype, device, **make_kwargs)
    grad_h, grad_alpha = make_grads(shape, dtype, device)
    result = run_op(query, sources, weight, grad_h, grad_alpha, backend)
    check_against_truth(result, truth(query, sources, weight, grad_h, grad_alpha), dtype)
