"""Attention Residuals (AttnRes), the op behind the AttnRes family (arXiv 2603.15031).

Per token, over N sources ``v_i`` (earlier sub-layer or block outputs, each [B, T, D]):

    k_i     = RMSNorm_g(v_i) = g * v_i / sqrt(mean(v_i ** 2) + eps)
    alpha_i = softmax_i(w . k_i)            (fp32; no logit scale)
    h       = sum_i alpha_i * v_i           (the raw sources, not the keys)

with ``w`` the call's pseudo-query [D] and ``g`` its RMSNorm weight [D]. Since
``w . (g * v / rms(v)) = (w * g) . v / rms(v)``, one read of a source gives both its logit and its norm.

Three implementations behind :func:`attention_residual`, one signature:

- ``"reference"``: the loop over sources, in float32 (float64 stays float64); autograd does the rest.
- ``"torch"``: a custom autograd Function over the *list* of sources (nothing is stacked; the backward
  saves references to the inputs and the [B, T, N] weights, logits and inverse norms). Sources of at
  most ``SMALL_NUMEL`` elements (cached decoding) take a stacked, vectorised autograd path instead: a
  few kernels per call whatever N, rather than several per source. Autocast is disabled inside.
  A caller whose calls share sources (the model) may compute each source's inverse norm once with
  :func:`source_inv_rms` and pass them (``inv_rms=`` of :func:`attention_residual_with_backend`): the list
  path then skips the norms and sends their gradient through them (summed over the calls by autograd).
- ``"triton"``: fused forward and backward kernels (``attnres_triton.py``) for CUDA tensors.

A caller whose calls share sources (the model) has two more torch-backend paths that score each source once,
when it is written, instead of once per call: ``shared_sources.py``.

The backend is chosen by the ``backend`` argument, else ``$DEPTHFUSION_BACKEND``, else automatically
(Triton for CUDA tensors when it imports, PyTorch otherwise). Inputs a kernel cannot compute are routed
by :func:`attention_residual_with_backend` (float64 goes to the PyTorch path). Second-order gradients
(``create_graph=True``) are computed by the reference and torch backends (the custom backward then
differentiates the reference); the Triton backward is first-order and raises a RuntimeError naming them.

This file must stay self-contained (only ``torch`` and same-folder relative imports): it is copied next
to the model code by ``save_pretrained`` for ``trust_remote_code`` loading.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


# Copied from depthfusion_hf.models.denseformer.dwa.triton_unavailable
def triton_unavailable(*_args: object) -> bool:
    """Stands in for the kernel module's availability checks when it does not import: the kernel runs nowhere."""
    return False


try:  # Triton is optional: the model loads and runs without it.
    from .attnres_triton import MAX_DIM as TRITON_MAX_DIM
    from .attnres_triton import SUPPORTED_DTYPES as TRITON_DTYPES
    from .attnres_triton import attnres_triton_available, attnres_triton_runs_on, triton_attention_residual
except Exception:  # pragma: no cover - depends on the environment
    triton_attention_residual = None
    TRITON_DTYPES = ()
    TRITON_MAX_DIM = 0
    attnres_triton_available = attnres_triton_runs_on = triton_unavailable


BACKENDS = ("reference", "torch", "triton")
BACKEND_ENV_VAR = "DEPTHFUSION_BACKEND"

# Per-source element count at or below which the torch backend stacks the sources (decoding steps).
SMALL_NUMEL = 1 << 14


# Copied from depthfusion_hf.models.denseformer.dwa.resolve_backend with _forward_backward->, dwa_->attnres_
def resolve_backend(backend: str | None, device: torch.device, config_backend: str | None = None) -> str:
    """Pick the implementation of the op: the one place that decides.

    ========================  =====================================================================
    precedence                where it comes from
    ========================  =====================================================================
    1. ``backend``            the op's ``backend=`` argument
    2. ``$DEPTHFUSION_BACKEND``  the environment variable (an override for a whole process)
    3. ``config_backend``     the model config's ``op_backend`` field (a model passes it)
    4. automatic              Triton for CUDA tensors when the kernel imports, else PyTorch
    ========================  =====================================================================

    A model calls this once per forward pass and device with ``backend=None``; that choice is logged at DEBUG
    (an explicit ``backend`` is not logged: ops called with a resolved backend stay silent).

    Args:
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` (any case) or None.
        device: the device of the op's tensors.
        config_backend: the config's ``op_backend`` (same values), used when neither ``backend`` nor the
            environment variable is set.
    Returns:
        ``"reference"``, ``"torch"`` or ``"triton"``.
    Raises:
        ValueError: for an unknown name, or ``"triton"`` where the kernel cannot run (no Triton, or
            tensors on a device other than CUDA without ``TRITON_INTERPRET=1``).
    """
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV_VAR) or config_backend or "auto"
    if not isinstance(choice, str):
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS} or None; got {choice!r}")
    choice = choice.lower()
    if choice == "auto":
        use_triton = device.type == "cuda" and attnres_triton_available()
        choice = "triton" if use_triton else "torch"
    elif choice not in BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {choice!r}")
    elif choice == "triton" and not attnres_triton_available():
        raise ValueError("backend='triton' was requested but Triton (or its kernel module) is not available")
    elif choice == "triton" and not attnres_triton_runs_on(device):
        raise ValueError(
            f"backend='triton' runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); got device {device}"
        )
    if backend is None:
        logger.debug("%s: backend %r on %s", __name__, choice, device)
    return choice


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"{type(x).__name__}"


def _check_vector(name: str, x: object, dim: int, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [D={dim}]; got {_describe(x)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype (float16, bfloat16, float32, float64); got {x.dtype}")
    if x.dim() != 1 or x.shape[0] != dim:
        raise ValueError(f"{name} must have shape [D={dim}] (D = the sources' last dim); got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on the sources' device {device}; got {x.device}")


def _as_source_list(sources: object) -> list[torch.Tensor]:
    if isinstance(sources, torch.Tensor):
        if sources.dim() != 4:
            raise ValueError(
                f"sources must be a sequence of N >= 1 tensors [B, T, D] or one tensor [N, B, T, D]; "
                f"got a tensor of shape {tuple(sources.shape)}"
            )
        return list(sources.unbind(0))
    if not isinstance(sources, Sequence) or isinstance(sources, (str, bytes)):
        raise ValueError(
            f"sources must be a sequence (list or tuple) of N >= 1 tensors [B, T, D]; got {_describe(sources)}"
        )
    return list(sources)


def check_attnres_inputs(
    query: torch.Tensor, sources: list[torch.Tensor], key_norm_weight: torch.Tensor, eps: float, return_weights: bool
) -> None:
    """Validate the op's inputs; raise ValueError naming the argument and the allowed values.

    Args:
        query: [D] floating. sources: N >= 1 tensors [B, T, D] of one shape, floating dtype and device.
        key_norm_weight: [D] floating. eps: positive finite float. return_weights: bool.
    """
    if len(sources) == 0:
        raise ValueError("sources must hold at least one tensor (N >= 1)")
    first = sources[0]
    for i, v in enumerate(sources):
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"sources[{i}] must be a torch.Tensor of shape [B, T, D]; got {_describe(v)}")
        if not v.is_floating_point():
            raise ValueError(
                f"sources must have a floating dtype (float16, bfloat16, float32, float64); sources[{i}] is {v.dtype}"
            )
        if v.dim() != 3:
            raise ValueError(f"sources must have shape [B, T, D]; sources[{i}] has shape {tuple(v.shape)}")
        if v.shape != first.shape or v.dtype != first.dtype or v.device != first.device:
            raise ValueError(
                f"all sources must share shape, dtype and device; sources[0] is {_describe(first)}, "
                f"sources[{i}] is {_describe(v)}"
            )
    if first.shape[-1] == 0:
        raise ValueError(f"sources must have a hidden size D >= 1; got shape {tuple(first.shape)}")
    _check_vector("query", query, first.shape[-1], first.device)
    _check_vector("key_norm_weight", key_norm_weight, first.shape[-1], first.device)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite float; got {eps!r}")
    if not isinstance(return_weights, bool):
        raise ValueError(f"return_weights must be a bool; got {return_weights!r}")


def compute_dtype(sources_dtype: torch.dtype, query: torch.Tensor, key_norm_weight: torch.Tensor) -> torch.dtype:
    """The dtype the logits, softmax and sums run in: float32, or float64 when any input is float64."""
    dtype = torch.promote_types(torch.promote_types(sources_dtype, query.dtype), key_norm_weight.dtype)
    return torch.promote_types(dtype, torch.float32)


def attnres_reference(
    query: torch.Tensor, sources: Sequence[torch.Tensor], key_norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The obvious loop over sources (see the module docstring); autograd differentiates it.

    Args:
        query: [D]. sources: N tensors [B, T, D]. key_norm_weight: [D]. eps: RMSNorm epsilon.
    Returns:
        ``(h, alpha)``: h [B, T, D] in the sources' dtype, alpha [B, T, N] in the compute dtype
        (float32, float64 for float64 inputs).
    """
    cd = compute_dtype(sources[0].dtype, query, key_norm_weight)
    w, g = query.to(cd), key_norm_weight.to(cd)
    xs = [v.to(cd) for v in sources]  # one cast per source: its gradient is rounded once
    logits = []
    for x in xs:
        k = g * x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
        logits.append((k * w).sum(dim=-1))
    alpha = torch.softmax(torch.stack(logits, dim=-1), dim=-1)
    h = alpha[..., 0:1] * xs[0]
    for i in range(1, len(xs)):
        h = h + alpha[..., i : i + 1] * xs[i]
    return h.to(sources[0].dtype), alpha


def local_aliases(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Aliases (views, in the graph) of a custom backward's saved inputs, for it to recompute its function from and
    differentiate with ``torch.autograd.grad`` under ``create_graph``: only that recomputation reads them, so the
    gradient with respect to them is the function's own. With respect to the inputs themselves it would be the
    total derivative through the forward graph, where one input may depend on another (a later source on an
    earlier one). The result stays connected to the inputs, for the higher-order gradients."""
    return [x.view_as(x) for x in tensors]


def _reference_grads(needs: Sequence[bool], query, key_norm_weight, sources, eps, grad_h, grad_alpha):
    """Double-backward path of the custom Function: differentiate the reference with ``create_graph``.

    ``needs``: whether query, key_norm_weight and each source need a gradient. Returns one entry per input
    (None where not needed); a source's gradient includes the path through its norm.
    """
    query, key_norm_weight, *sources = inputs = local_aliases([query, key_norm_weight, *sources])
    wanted = [x for x, need in zip(inputs, needs) if need]
    h, alpha = attnres_reference(query, sources, key_norm_weight, eps)
    outs, grads_out = [h], [grad_h if grad_h is not None else torch.zeros_like(h)]
    if grad_alpha is not None:
        outs.append(alpha)
        grads_out.append(grad_alpha.to(alpha.dtype))
    found = iter(torch.autograd.grad(outs, wanted, grads_out, create_graph=True, allow_unused=True))
    return [next(found) if need else None for need in needs]


class _InvRms(torch.autograd.Function):
    """``r = rsqrt(mean(v ** 2, -1) + eps)`` [B, T] (compute dtype) of one source [B, T, D], one read each way."""

    @staticmethod
    def forward(ctx, source, eps):  # noqa: D102
        x = source.detach().to(torch.promote_types(source.dtype, torch.float32))
        r = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1).square_().div_(x.shape[-1]).add_(eps))
        ctx.save_for_backward(source, r)
        return r

    @staticmethod
    def backward(ctx, grad_r):  # noqa: D102
        source, r = ctx.saved_tensors
        coef = grad_r * r.pow(3) / (-source.shape[-1])  # dr/dv = -r^3 v / D; differentiable (double backward)
        return (source.to(r.dtype) * coef.unsqueeze(-1)).to(source.dtype), None


def source_inv_rms(source: torch.Tensor, eps: float) -> torch.Tensor:
    """The inverse RMS norm of a source, to compute once and pass to every call that reads it.

    Args:
        source: [B, T, D] floating. eps: the calls' RMSNorm epsilon.
    Returns:
        ``rsqrt(mean(source ** 2, -1) + eps)`` [B, T] in float32 (float64 for float64 sources), differentiable.
    """
    return _InvRms.apply(source, eps)


class _AttentionResidual(torch.autograd.Function):
    """The torch backend over a list of sources (inputs: query, key_norm_weight, eps, N, *sources, *inv_rms).

    ``inv_rms`` is empty (the norms are computed here) or holds each source's inverse norm
    ``r_i = rsqrt(mean(v_i^2) + eps)`` [B, T] from :func:`source_inv_rms` (computed once per source by a
    model whose calls share sources): the gradient through the norm then goes to ``r_i`` ([B, T], summed
    by autograd over the calls) instead of to ``v_i`` once per call.

    Forward: per source one matrix-vector product (``p_i = (w * g) . v_i``; logit ``s_i = r_i p_i``),
    an fp32 softmax over the [B, T, N] logits, then ``h = sum_i alpha_i v_i`` accumulated into one
    buffer. Saved: references to the inputs, and alpha, p and r ([B, T, N] each).

    Backward (per token, ``u = w * g``, ``delta = sum_j alpha_j dalpha_j``):
    ``dalpha_i = dh . v_i (+ d alpha_i)``, ``ds_i = alpha_i (dalpha_i - delta)``,
    ``dv_i = alpha_i dh + ds_i r_i u`` (+ ``- ds_i p_i r_i^3 v_i / D`` when the norm is computed here),
    ``dr_i = ds_i p_i``, ``du = sum_tokens sum_i ds_i r_i v_i``, ``dw = du * g``, ``dg = du * w``.
    """

    @staticmethod
    def forward(ctx, query, key_norm_weight, eps, n_src, *tensors):  # noqa: D102
        sources, given_rms = tensors[:n_src], tensors[n_src:]
        dtype = sources[0].dtype
        cd = compute_dtype(dtype, query, key_norm_weight)
        u = query.detach().to(cd) * key_norm_weight.detach().to(cd)
        dim = sources[0].shape[-1]
        dots, inv_rms = [], []
        # u . v_i as a product into one scratch buffer and a row sum: on CPU about 1.5x faster than the
        # memory-bound matrix-vector product for sources that are not in cache (scripts/bench_attnres.py)
        scratch = torch.empty(sources[0].shape, dtype=cd, device=u.device)
        for i, v in enumerate(sources):
            x = v.detach()
            if given_rms:
                r = given_rms[i].detach()
            else:
                r = torch.rsqrt(torch.linalg.vector_norm(x.to(cd), dim=-1).square_().div_(dim).add_(eps))
            dots.append(torch.mul(x, u, out=scratch).sum(dim=-1))
            inv_rms.append(r)
        dots, inv_rms = torch.stack(dots, dim=-1), torch.stack(inv_rms, dim=-1)
        alpha = torch.softmax(dots * inv_rms, dim=-1)
        h = torch.mul(sources[0].detach().to(cd), alpha[..., 0:1])
        for i in range(1, len(sources)):
            h.addcmul_(sources[i].detach(), alpha[..., i : i + 1])
        ctx.eps, ctx.device_type, ctx.n_src, ctx.given_rms = eps, sources[0].device.type, n_src, bool(given_rms)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(query, key_norm_weight, alpha, dots, inv_rms, *sources)
        return h.to(dtype), alpha

    @staticmethod
    def backward(ctx, grad_h, grad_alpha):  # noqa: D102
        with torch.autocast(device_type=ctx.device_type, enabled=False):  # fp32 math in a backward under autocast
            return _AttentionResidual._backward(ctx, grad_h, grad_alpha)

    @staticmethod
    def _backward(ctx, grad_h, grad_alpha):
        query, key_norm_weight, alpha, dots, inv_rms, *sources = ctx.saved_tensors
        n_src = ctx.n_src
        need_src = ctx.needs_input_grad[4 : 4 + n_src]
        need_rms = ctx.needs_input_grad[4 + n_src :] if ctx.given_rms else ()
        no_rms = [None] * len(need_rms)
        if grad_h is None and grad_alpha is None:
            return (None, None, None, None, *([None] * n_src), *no_rms)
        if torch.is_grad_enabled():  # create_graph: differentiate the reference (norm path into the sources)
            d_q, d_g, *d_src = _reference_grads(ctx.needs_input_grad[:2] + need_src, query, key_norm_weight,
                                                sources, ctx.eps, grad_h, grad_alpha)
            return (d_q, d_g, None, None, *d_src, *no_rms)
        cd = alpha.dtype
        dim = sources[0].shape[-1]
        w, g = query.to(cd), key_norm_weight.to(cd)
        u = w * g
        dh = grad_h.to(cd) if grad_h is not None else None
        d_alpha = torch.zeros_like(alpha) if grad_alpha is None else grad_alpha.to(cd).clone()
        scratch = torch.empty(sources[0].shape, dtype=cd, device=alpha.device)  # one product buffer, reused
        if dh is not None:
            for i, v in enumerate(sources):
                d_alpha[..., i] += torch.mul(dh, v, out=scratch).sum(dim=-1)
        delta = (alpha * d_alpha).sum(dim=-1, keepdim=True)
        ds = alpha * (d_alpha - delta)  # [B, T, N]: gradient of the logits
        coef_u = ds * inv_rms  # ds_i r_i
        need_u = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if need_u:  # du = sum_tokens sum_i (ds_i r_i) v_i: summed over sources elementwise, then over tokens once
            scratch.zero_()
        grad_sources: list[torch.Tensor | None] = []
        for i, v in enumerate(sources):
            if not (need_src[i] or need_u):
                grad_sources.append(None)
                continue
            x = v.to(cd)
            c_u = coef_u[..., i]
            if need_u:
                scratch.addcmul_(x, c_u.unsqueeze(-1))
            if not need_src[i]:
                grad_sources.append(None)
                continue
            dv = torch.outer(c_u.reshape(-1), u).view(v.shape)  # ds_i r_i u, a fresh contiguous buffer
            if not (ctx.given_rms and need_rms[i]):  # the norm's gradient goes to v_i here
                dv.addcmul_(x, (c_u * dots[..., i] * inv_rms[..., i].square() / (-dim)).unsqueeze(-1))
            if dh is not None:
                dv.addcmul_(dh, alpha[..., i : i + 1])
            grad_sources.append(dv.to(v.dtype))
        grad_rms = [(ds[..., i] * dots[..., i]).to(inv_rms.dtype) if need else None for i, need in enumerate(need_rms)]
        du = scratch.reshape(-1, dim).sum(dim=0) if need_u else None
        d_q = (du * g).to(query.dtype) if ctx.needs_input_grad[0] else None
        d_g = (du * w).to(key_norm_weight.dtype) if ctx.needs_input_grad[1] else None
        return (d_q, d_g, None, None, *grad_sources, *grad_rms)


def _attnres_small(
    query: torch.Tensor, sources: Sequence[torch.Tensor], key_norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Few elements per source: stack them ([B, T, N, D], a negligible copy) and vectorise; plain autograd."""
    dtype = sources[0].dtype
    cd = compute_dtype(dtype, query, key_norm_weight)
    x = torch.stack(tuple(sources), dim=-2).to(cd)  # [B, T, N, D]
    u = query.to(cd) * key_norm_weight.to(cd)
    r = torch.rsqrt(x.pow(2).mean(dim=-1) + eps)  # [B, T, N]
    # Elementwise products and sums, not matmuls: autocast (also active in a backward) leaves them alone.
    alpha = torch.softmax((x * u).sum(dim=-1) * r, dim=-1)
    h = (alpha.unsqueeze(-1) * x).sum(dim=-2)
    return h.to(dtype), alpha


def attnres_torch(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    key_norm_weight: torch.Tensor,
    eps: float,
    inv_rms: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The efficient PyTorch backend (:class:`_AttentionResidual`, or the stacked path for small sources).

    Autocast is disabled inside: the logits, softmax and sums run in the compute dtype of the inputs.

    Args:
        query: [D]. sources: N tensors [B, T, D]. key_norm_weight: [D]. eps: RMSNorm epsilon.
        inv_rms: optional, N tensors [B, T]: ``source_inv_rms(sources[i], eps)`` (computed once per source
            by a caller whose calls share sources); the stacked small path recomputes them instead.
    Returns:
        ``(h, alpha)`` as :func:`attnres_reference`.
    """
    device_type = sources[0].device.type
    if torch.is_autocast_enabled(device_type):  # products in half precision: the op keeps its fp32 math
        with torch.autocast(device_type=device_type, enabled=False):
            return attnres_torch(query, sources, key_norm_weight, eps, inv_rms)
    if sources[0].numel() <= SMALL_NUMEL:
        return _attnres_small(query, sources, key_norm_weight, eps)
    rms = tuple(inv_rms) if inv_rms is not None else ()
    return _AttentionResidual.apply(query, key_norm_weight, eps, len(sources), *sources, *rms)


def _route(backend: str, sources: Sequence[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor) -> str:
    """The one place that sends inputs a kernel cannot compute elsewhere: float64 work (or D > the kernel's
    ``MAX_DIM``) leaves Triton for torch."""
    if backend == "triton" and (
        compute_dtype(sources[0].dtype, query, key_norm_weight) not in TRITON_DTYPES
        or sources[0].shape[-1] > TRITON_MAX_DIM
    ):
        return "torch"
    return backend


def attention_residual_with_backend(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    key_norm_weight: torch.Tensor,
    eps: float,
    return_weights: bool,
    backend: str,
    inv_rms: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run an already resolved backend on already validated inputs (the model's per-call fast path).

    Args:
        query: [D]. sources: N >= 1 tensors [B, T, D] (one dtype and device). key_norm_weight: [D].
        eps: RMSNorm epsilon. return_weights: also return alpha.
        backend: ``"reference"``, ``"torch"`` or ``"triton"`` (from :func:`resolve_backend`); float64
            work asked of ``"triton"`` runs on ``"torch"``.
        inv_rms: optional, N tensors [B, T], ``source_inv_rms(sources[i], eps)`` of each source, computed once
            by a caller whose calls share sources (the torch backend then skips the norms and sends their
            gradient through ``inv_rms``); the other backends recompute the norms and ignore it.
    Returns:
        h [B, T, D] in the sources' dtype, or ``(h, alpha)`` with alpha [B, T, N] float32 (float64 for
        float64 inputs).
    """
    backend = _route(backend, sources, query, key_norm_weight)
    if backend == "reference":
        h, alpha = attnres_reference(query, sources, key_norm_weight, eps)
    elif backend == "triton":
        h, alpha = triton_attention_residual(query, list(sources), key_norm_weight, eps)
    else:
        h, alpha = attnres_torch(query, sources, key_norm_weight, eps, inv_rms)
    return (h, alpha) if return_weights else h


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

    Differentiable in ``query``, ``key_norm_weight`` and every source (second order included).

    Args:
        query: [D], the pseudo-query ``w`` of this call (any floating dtype).
        sources: a sequence of N >= 1 tensors [B, T, D] (one shape, floating dtype and device; any
            strides), or one tensor [N, B, T, D].
        key_norm_weight: [D], the RMSNorm weight ``g`` applied to the keys (any floating dtype).
        eps: the RMSNorm epsilon (positive).
        return_weights: also return the softmax weights.
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` or None (then
            ``$DEPTHFUSION_BACKEND``, default ``"auto"``).
    Returns:
        h [B, T, D] in the sources' dtype; with ``return_weights`` also alpha [B, T, N] float32
        (float64 when an input is float64), rows summing to 1.
    Raises:
        ValueError: when a shape, dtype or device does not fit (the message names the argument and the
            allowed values), ``eps`` is not positive, or the backend is unknown or unavailable.
    """
    source_list = _as_source_list(sources)
    check_attnres_inputs(query, source_list, key_norm_weight, eps, return_weights)
    choice = resolve_backend(backend, source_list[0].device)
    return attention_residual_with_backend(query, source_list, key_norm_weight, float(eps), return_weights, choice)


__all__ = [
    "attention_residual",
    "attention_residual_with_backend",
    "attnres_reference",
    "attnres_torch",
    "check_attnres_inputs",
    "resolve_backend",
    "source_inv_rms",
]
