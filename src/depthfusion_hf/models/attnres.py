"""Attention Residuals (AttnRes), the op behind the AttnRes family (arXiv 2603.15031).

Per token, over N sources ``v_i`` [B, T, D], with the call's pseudo-query ``w`` [D] and key-RMSNorm weight ``g``
[D], ``u = w * g``:

    p_i = u . v_i,   r_i = rsqrt(mean(v_i ** 2) + eps),   s_i = r_i p_i   (= w . RMSNorm_g(v_i))
    alpha = softmax_i(s_i)   (no logit scale),   h = sum_i alpha_i v_i   (the raw sources, not the keys)
    backward: dalpha_i = dh . v_i (+ the weights' own gradient),  ds_i = alpha_i (dalpha_i - sum_j alpha_j dalpha_j),
    b_i = ds_i r_i,  e_i = -b_i p_i r_i^2 / D,  dv_i = alpha_i dh + b_i u + e_i v_i,  du = sum_tokens sum_i b_i v_i,
    dw = du * g,  dg = du * w.

:func:`attention_residual` is the one entry point. It validates, picks the backend with :func:`resolve_backend`
(argument > ``$DEPTHFUSION_BACKEND`` > the config's ``op_backend`` > automatic: Triton for CUDA tensors when it
imports, else torch) and hands over to :func:`attnres_core` (what a model calls, with the backend it resolved once
per forward), which decides the compute dtype (below) and calls one implementation:

============  ====================================================  =====================  ===============
backend       implementation                                        compute dtypes         create_graph
============  ====================================================  =====================  ===============
reference     :func:`attnres_reference`: the loop over sources,     any floating           yes
              plain autograd (the oracle)
torch         :class:`AttnResFunction`: one custom autograd          any floating           yes (exact)
              Function over the *list* of sources (the formulas
              above; saves references and three [B, T, N] tensors)
triton        ``attnres_triton.py``: fused kernels, CUDA tensors     fp32, bf16, fp16 (any   RuntimeError
              (CPU under ``TRITON_INTERPRET=1``)                     mix); D <= ``MAX_DIM``
============  ====================================================  =====================  ===============

Work the kernel cannot compute (a float64 compute dtype, D past ``MAX_DIM``) asked of Triton runs on torch. fp32
on CUDA stays on the kernel (elementwise fp32 FMAs and row sums: no tensor-core matmul, so TF32 never applies).

**Compute dtype** (:func:`compute_dtype`), one for every backend: the promoted dtype of the floating inputs, also
under autocast, as DWA's (the op mixes the residual stream, which stays fp32 under autocast as a Llama's does).
Every implementation reads each source in its own dtype, accumulates in fp32 (float64 for float64) with autocast
off, returns h in the compute dtype and alpha in fp32 (float64), and rounds a source's gradient once to its dtype.

This file must stay self-contained (only ``torch`` and same-folder relative imports): it is copied next to the
model code by ``save_pretrained`` for ``trust_remote_code`` loading.
"""

import functools
import math
from collections.abc import Sequence

import torch

from .depthfusion_common import BACKEND_ENV_VAR, BACKENDS  # noqa: F401 - part of the op's API
from .depthfusion_common import resolve_backend as resolve_op_backend

try:  # Triton is optional: the model loads and runs without it.
    from .attnres_triton import MAX_DIM as TRITON_MAX_DIM
    from .attnres_triton import SUPPORTED_DTYPES as TRITON_DTYPES
    from .attnres_triton import triton_attention_residual
except Exception:  # pragma: no cover - depends on the environment
    triton_attention_residual = None
    TRITON_DTYPES = ()
    TRITON_MAX_DIM = 0



# Per-source element count at or below which the torch forward stacks the sources (cached decoding: a few KB;
# one vectorised product instead of a few operators per source). The backward always runs over the list.
SMALL_NUMEL = 1 << 14


def resolve_backend(backend: str | None, device: torch.device, config_backend: str | None = None) -> str:
    """The AttnRes backend: ``"reference"``, ``"torch"`` or ``"triton"``, chosen by the one rule of
    :func:`depthfusion_common.resolve_backend` (the ``backend`` argument, ``$DEPTHFUSION_BACKEND``, the config's
    ``op_backend``, automatic); a ValueError for an unknown name or a Triton backend that cannot run."""
    return resolve_op_backend(backend, device, config_backend, kernels_imported=triton_attention_residual is not None,
                              op=__name__)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return type(x).__name__


def check_attnres_inputs(query, sources, key_norm_weight, eps, return_weights) -> None:
    """Validate the op's inputs (no host sync); raise a ValueError naming the first problem and the allowed values."""
    if not isinstance(sources, (list, tuple)) or len(sources) == 0:
        raise ValueError(f"sources must be a sequence (list or tuple) of N >= 1 tensors [B, T, D] (at least one tensor)"
                         f" or one tensor [N, B, T, D]; got {_describe(sources)}")
    for name, x in [(f"sources[{i}]", v) for i, v in enumerate(sources)] + [("query", query),
                                                                            ("key_norm_weight", key_norm_weight)]:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {_describe(x)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must have a floating dtype (float16, bfloat16, float32, float64); got {x.dtype}")
    first = sources[0]
    for i, v in enumerate(sources):
        if v.shape != first.shape or v.device != first.device:
            raise ValueError(f"all sources must share shape and device; sources[0] is {_describe(first)}, "
                             f"sources[{i}] is {_describe(v)}")
    if first.dim() != 3 or first.shape[-1] == 0:
        raise ValueError(f"sources must have shape [B, T, D] with a hidden size D >= 1; got shape {tuple(first.shape)}")
    for name, x in (("query", query), ("key_norm_weight", key_norm_weight)):
        if x.shape != first.shape[-1:]:
            raise ValueError(f"{name} must have shape [D={first.shape[-1]}] (D = the sources' last dim); "
                             f"got {tuple(x.shape)}")
        if x.device != first.device:
            raise ValueError(f"{name} must be on the sources' device {first.device}; got {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite float; got {eps!r}")
    if not isinstance(return_weights, bool):
        raise ValueError(f"return_weights must be a bool; got {return_weights!r}")


def compute_dtype(query, sources, key_norm_weight) -> torch.dtype:
    """The op's one compute (and output) dtype, for every backend: the promoted dtype of its inputs (autocast does
    not lower it: see the module docstring)."""
    return functools.reduce(torch.promote_types, {query.dtype, key_norm_weight.dtype, *(v.dtype for v in sources)})


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the half types and fp32, float64 for float64: every input converts to it exactly."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def attnres_reference(query, sources, key_norm_weight, eps, dtype=None):
    """The paper's formula, a loop over the sources (query [D], N sources [B, T, D], key_norm_weight [D]) in the
    accumulation dtype; autograd differentiates it. Returns ``(h [B, T, D] in dtype (default: the promoted dtype of
    the inputs), alpha [B, T, N] in the accumulation dtype)``.
    """
    dtype = dtype or compute_dtype(query, sources, key_norm_weight)
    acc = accumulation_dtype(dtype)
    w, g = query.to(acc), key_norm_weight.to(acc)
    xs = [v.to(acc) for v in sources]
    logits = [(g * x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w).sum(dim=-1) for x in xs]
    alpha = torch.softmax(torch.stack(logits, dim=-1), dim=-1)
    h = sum(alpha[..., i : i + 1] * x for i, x in enumerate(xs))
    return h.to(dtype), alpha


def _rowdot(a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor | None) -> torch.Tensor:
    """``sum(a * b, -1)``: the product into ``scratch`` (a reused [B, T, D] buffer: no allocation per source, on
    CPU faster than BLAS's memory-bound matrix-vector product), or out of place (``scratch`` None: autograd)."""
    return torch.linalg.vecdot(a, b) if scratch is None else torch.mul(a, b, out=scratch).sum(dim=-1)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _scores(u, sources, eps, scratch=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``p``, ``r`` [B, T, N] in u's dtype (module docstring): one dot product and one norm per source, each source
    read in its own dtype (into ``scratch``; cast to u's dtype for autograd)."""
    dots, norms = [], []
    for v in sources:
        dots.append(_rowdot(v if scratch is not None else _as(v, u.dtype), u, scratch))
        norms.append(torch.linalg.vector_norm(v, dim=-1, dtype=u.dtype))
    return torch.stack(dots, dim=-1), torch.rsqrt(torch.stack(norms, dim=-1).square() / u.shape[0] + eps)


def attnres_torch_forward(query, sources, key_norm_weight, eps, dtype):
    """The torch backend's forward: ``(h, alpha, p, r)``, h [B, T, D] in ``dtype``, the rest [B, T, N] in fp32/64.
    Sources of at most ``SMALL_NUMEL`` elements (decoding) are stacked transiently; larger ones are read in a loop."""
    acc = accumulation_dtype(dtype)
    u = _as(query, acc) * _as(key_norm_weight, acc)
    if sources[0].numel() <= SMALL_NUMEL:
        x = _as(torch.stack(sources, dim=-2), acc)  # (stack promotes mixed dtypes)
        p, r = x @ u, torch.linalg.vecdot(x, x).div_(x.shape[-1]).add_(eps).rsqrt_()
        alpha = torch.softmax(p * r, dim=-1)
        h = torch.linalg.vecdot(alpha.unsqueeze(-1), x, dim=-2)
        return _as(h, dtype), alpha, p, r
    h = torch.empty(sources[0].shape, dtype=acc, device=u.device)  # the product buffer of the scores, then h
    p, r = _scores(u, sources, eps, h)
    alpha = torch.softmax(p * r, dim=-1)
    weights = alpha.unsqueeze(-1).unbind(-2)  # N views [B, T, 1]
    torch.mul(sources[0], weights[0], out=h)
    for v, a in zip(sources[1:], weights[1:]):
        h.addcmul_(v, a)
    return _as(h, dtype), alpha, p, r


class AttnResFunction(torch.autograd.Function):
    """The torch backend with autograd: ``(dtype, query, key_norm_weight, eps, *sources)`` -> ``(h, alpha)``.

    Saves references to the inputs and ``p``, ``r``, ``alpha`` [B, T, N]; the backward is the module docstring's
    formulas over the list of sources in differentiable torch ops (under ``create_graph=True`` it recomputes
    ``p``, ``r``, ``alpha`` with autograd recording and uses no ``out=`` buffers: exact second order)."""

    @staticmethod
    def forward(ctx, dtype, query, key_norm_weight, eps, *sources):  # noqa: D102
        h, alpha, p, r = attnres_torch_forward(query, sources, key_norm_weight, eps, dtype)
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(query, key_norm_weight, p, r, alpha, *sources)
        return h, alpha

    @staticmethod
    def backward(ctx, grad_h, grad_alpha):  # noqa: D102
        query, key_norm_weight, p, r, alpha, *sources = ctx.saved_tensors
        acc, shape = alpha.dtype, sources[0].shape
        w, g = query.to(acc), key_norm_weight.to(acc)
        u = w * g
        scratch = None if torch.is_grad_enabled() else torch.empty(shape, dtype=acc, device=alpha.device)
        if scratch is None:  # create_graph: p, r, alpha as differentiable functions of the inputs
            p, r = _scores(u, sources, ctx.eps)
            alpha = torch.softmax(p * r, dim=-1)
        dh = None if grad_h is None else _as(grad_h, acc)
        d_alpha = torch.zeros_like(alpha) if dh is None else torch.stack(
            [_rowdot(dh, _as(v, acc), scratch) for v in sources], dim=-1)
        if grad_alpha is not None:
            d_alpha = d_alpha + grad_alpha
        ds = alpha * (d_alpha - (alpha * d_alpha).sum(dim=-1, keepdim=True))
        b = ds * r
        e = b * p * r.square() / -shape[-1]
        need_u = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        du = (torch.zeros(shape, dtype=acc, device=alpha.device) if scratch is None else scratch.zero_()) if need_u \
            else None  # [B, T, D]: summed over the sources here, over the tokens after the loop
        grads = []
        for i, (v, a_i, b_i, e_i) in enumerate(zip(sources, *(t.unsqueeze(-1).unbind(-2) for t in (alpha, b, e)))):
            x = _as(v, acc)  # each source is cast to the accumulation dtype where it is read
            if need_u:
                du.addcmul_(x, b_i)
            if not ctx.needs_input_grad[4 + i]:
                grads.append(None)
                continue
            dv = torch.mul(b_i, u).addcmul_(x, e_i)
            dv = dv if dh is None else dv.addcmul_(dh, a_i)
            grads.append(_as(dv, v.dtype))
        du = du.reshape(-1, shape[-1]).sum(dim=0) if need_u else None
        d_q = (du * g).to(query.dtype) if ctx.needs_input_grad[1] else None
        d_g = (du * w).to(key_norm_weight.dtype) if ctx.needs_input_grad[2] else None
        return (None, d_q, d_g, None, *grads)


def attention_residual(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor] | torch.Tensor,
    key_norm_weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    return_weights: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention Residuals: per token, a softmax over the sources of ``w . RMSNorm_g(v_i)``, then ``sum alpha_i v_i``.

    The one entry point of the op (dispatch table and compute dtype: module docstring). Differentiable in
    ``query``, ``key_norm_weight`` and every source (second order on the reference and torch backends).

    Args:
        query: [D], the pseudo-query ``w``. key_norm_weight: [D], the keys' RMSNorm weight ``g``.
        sources: N >= 1 tensors [B, T, D] (a list or tuple; one shape and device; any floating dtypes, which
            may differ from source to source, and any strides), or one tensor [N, B, T, D].
        eps: the RMSNorm epsilon (positive). return_weights: also return the softmax weights.
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` or None (:func:`resolve_backend`).
    Returns:
        h [B, T, D] in the compute dtype (the promoted dtype of the inputs, also under autocast); with
        ``return_weights`` also alpha [B, T, N] (float32, float64 for float64 work), rows summing to 1.
    Raises:
        ValueError: an input that does not fit (naming the argument and the allowed values), or a backend
            unknown or unavailable.
    """
    if isinstance(sources, torch.Tensor) and sources.dim() == 4:
        sources = sources.unbind(0)
    check_attnres_inputs(query, sources, key_norm_weight, eps, return_weights)
    h, alpha = attnres_core(resolve_backend(backend, sources[0].device), query, sources, key_norm_weight, float(eps))
    return (h, alpha) if return_weights else h


def attnres_core(backend: str, query, sources, key_norm_weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_residual` past its input check and backend resolution, for inputs known to be valid: a
    model resolves ``backend`` once per forward (:func:`resolve_backend`) and calls this per use. Decides the
    compute dtype and runs ``backend`` (Triton work it cannot compute goes to torch) with autocast off. Returns
    ``(h [B, T, D], alpha [B, T, N])``."""
    dtype = compute_dtype(query, sources, key_norm_weight)
    device = sources[0].device.type
    if backend == "triton" and (dtype not in TRITON_DTYPES or sources[0].shape[-1] > TRITON_MAX_DIM):
        backend = "torch"
    if (device in ("cpu", "cuda") or torch.amp.is_autocast_available(device)) and torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):  # the dtype is decided: autocast must not recast the products
            return _run(backend, query, sources, key_norm_weight, eps, dtype)
    return _run(backend, query, sources, key_norm_weight, eps, dtype)


def _run(backend: str, query, sources, key_norm_weight, eps: float, dtype: torch.dtype):
    if backend == "reference":
        return attnres_reference(query, sources, key_norm_weight, eps, dtype)
    if backend == "triton":
        return triton_attention_residual(query, list(sources), key_norm_weight, eps, dtype)
    if torch.is_grad_enabled():
        return AttnResFunction.apply(dtype, query, key_norm_weight, eps, *sources)
    return attnres_torch_forward(query, sources, key_norm_weight, eps, dtype)[:2]  # no autograd node to record


__all__ = ["attention_residual", "attnres_core", "attnres_reference", "check_attnres_inputs", "compute_dtype",
           "resolve_backend"]
