"""The AttnRes model's training path (torch backend) for calls that share their sources: each source is scored
once, when it is written, instead of once per call reading it (the op itself, one call at a time, is
``attnres.py``; the cached-decoding path is ``depth_buffer.py``).

With gradients over many tokens (:func:`uses_logit_rows`): :func:`call_keys` takes every call's
``u_c = w_c * g_c`` once per forward, :func:`source_logit_rows` gives a written source its logits
``r (u_c . v)`` for the calls that read it (one product), and :func:`attention_residual_from_rows` runs a
call from its sources' rows (softmax, weighted sum; the backward returns ``alpha_i dh`` per source and the
logit gradients, which reach the sources, queries and norm weights through the rows' products).

This file must stay self-contained (only ``torch`` and same-folder relative imports): it is copied next to the
model code by ``save_pretrained`` for ``trust_remote_code`` loading.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attnres import SMALL_NUMEL, local_aliases, source_inv_rms


def uses_logit_rows(backend: str, source: torch.Tensor) -> bool:
    """Whether a caller whose calls share sources should score each source once (:func:`source_logit_rows`)
    and run its calls with :func:`attention_residual_from_rows`.

    Only on the torch backend's list path: backend ``"torch"``, sources of more than ``SMALL_NUMEL`` elements,
    gradients enabled (without gradients the :class:`DepthBuffer` or the per-call path serve).

    Args:
        backend: a resolved backend. source: one source [B, T, D] (all share its shape).
    """
    return backend == "torch" and torch.is_grad_enabled() and source.numel() > SMALL_NUMEL


def parameter_versions(tensors: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """The version counters of ``tensors`` (bumped by every in-place change), to tell later whether a value
    computed from them is stale; None when one has none (an inference tensor): then do not cache from them."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:
        return None


def call_keys(
    queries: Sequence[torch.Tensor], key_norm_weights: Sequence[torch.Tensor], source_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Every call's ``u_c = w_c * g_c``: [C, D] in the compute dtype (differentiable), for :func:`source_logit_rows`.

    Args:
        queries: C tensors [D] (the calls' ``w``). key_norm_weights: C tensors [D] (their ``g``).
        source_dtype: the sources' dtype: float64 sources take the product in float64 (as the op does).
    """
    w, g = torch.stack(tuple(queries)), torch.stack(tuple(key_norm_weights))
    cd = torch.promote_types(torch.promote_types(w.dtype, g.dtype), torch.promote_types(source_dtype, torch.float32))
    return w.to(cd) * g.to(cd)


def source_logit_rows(source: torch.Tensor, keys: torch.Tensor, eps: float, pass_source: bool = False):
    """A source's logit in every call, computed once when the source is written: ``r (u_c . v)`` for each c.

    One [M, D] x [D, C] product per source replaces one dot product per call reading it; its gradient reaches
    the source and the keys through two products per source (not one accumulation per call).

    Args:
        source: v [B, T, D]. keys: [C, D] from :func:`call_keys`, or the rows of the calls that read this source.
        eps: the calls' RMSNorm epsilon. pass_source: also return the source passed through (a view), for the
            caller to use instead: its gradient then meets the rows' in one buffer (see :class:`_SourceRows`).
    Returns:
        [B, T, C] in the keys' dtype (the compute dtype: float32, float64 for float64 inputs), differentiable;
        with ``pass_source``, ``(rows, passed source)``.
    """
    with torch.autocast(device_type=source.device.type, enabled=False):  # the logits stay in the compute dtype
        cd = torch.promote_types(source.dtype, keys.dtype)
        rows, passed = _SourceRows.apply(source, keys.to(cd), eps)
    return (rows, passed) if pass_source else rows


def _source_rows_reference(source: torch.Tensor, keys: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`_SourceRows` with autograd's ops (for double backward)."""
    return torch.matmul(source.to(keys.dtype), keys.t()) * source_inv_rms(source, eps).to(keys.dtype).unsqueeze(-1)


class _SourceRows(torch.autograd.Function):
    """A source's logit rows ``r (u_c . v)`` (inputs: source v [B, T, D], keys u [C, D] in the compute dtype, eps).

    Forward: ``r = rsqrt(mean(v^2) + eps)`` [B, T], ``p = v u^T`` [B, T, C], rows ``p r``; outputs ``(rows, v)`` (v
    passed through as a view, for the caller's later use). Backward (``g`` the rows' gradient, ``gv`` the passed
    view's): ``dv = gv + (g r) u - (sum_c g p) r^3 v / D`` into one buffer (one product adding onto ``gv``, one
    multiply-add), ``du = (g r)^T v``: no separate norm gradient or product for autograd to add to the source's.
    Saved: references to v and u, r and p.
    """

    @staticmethod
    def forward(ctx, source, keys, eps):  # noqa: D102
        x = source.to(keys.dtype)
        r = source_inv_rms(source, eps).to(keys.dtype)  # (no graph: only its value, in forward)
        # p^T = u x^T [C, B*T] (BLAS is faster this way round for few calls), viewed as [B, T, C]: each call's
        # column of the rows is then contiguous
        p = torch.matmul(keys, x.reshape(-1, x.shape[-1]).t()).view(keys.shape[0], *x.shape[:-1]).movedim(0, -1)
        ctx.eps, ctx.device_type = eps, source.device.type
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(source, keys, r, p)
        return p * r.unsqueeze(-1), source

    @staticmethod
    def backward(ctx, grad_rows, grad_passed):  # noqa: D102
        source, keys, r, p = ctx.saved_tensors
        need_source, need_keys = ctx.needs_input_grad[:2]
        if grad_rows is None:
            return grad_passed, None, None
        if torch.is_grad_enabled():  # create_graph: differentiate the same function written with autograd's ops
            source, keys = local_aliases((source, keys))
            wanted = [x for x, nd in zip((source, keys), (need_source, need_keys)) if nd]
            found = iter(torch.autograd.grad(_source_rows_reference(source, keys, ctx.eps), wanted, grad_rows,
                                             create_graph=True, allow_unused=True))
            grad_source, grad_keys = next(found) if need_source else None, next(found) if need_keys else None
            if grad_passed is not None and need_source:
                grad_source = grad_passed if grad_source is None else grad_source + grad_passed
            return grad_source, grad_keys, None
        with torch.autocast(device_type=ctx.device_type, enabled=False):
            g = grad_rows.to(keys.dtype)
            gr = g * r.unsqueeze(-1)  # [B, T, C]: the gradient of p
            x = source.to(keys.dtype)
            grad_source = grad_keys = None
            if need_source:
                coef = (g * p).sum(dim=-1).mul_(r.pow(3)).div_(-x.shape[-1])  # dr * dr/d(mean square) / D
                if grad_passed is None:
                    grad_source = torch.matmul(gr, keys)
                else:  # the passed view's gradient + (g r) u in one product
                    flat = grad_passed.to(keys.dtype).reshape(-1, x.shape[-1])
                    grad_source = torch.addmm(flat, gr.reshape(-1, gr.shape[-1]), keys).view(x.shape)
                grad_source = grad_source.addcmul_(x, coef.unsqueeze(-1)).to(source.dtype)
            if need_keys:
                grad_keys = torch.matmul(gr.reshape(-1, gr.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
            return grad_source, grad_keys, None


def _mix_rows_reference(columns: Sequence[int], sources: Sequence[torch.Tensor], rows: Sequence[torch.Tensor]):
    """:class:`_MixFromRows` with autograd's ops (for double backward): ``(h, alpha)``."""
    logits = torch.stack([row[..., j] for row, j in zip(rows, columns)], dim=-1)
    alpha = torch.softmax(logits, dim=-1)
    h = alpha[..., 0:1] * sources[0].to(alpha.dtype)
    for i in range(1, len(sources)):
        h = h + alpha[..., i : i + 1] * sources[i].to(alpha.dtype)
    return h.to(sources[0].dtype), alpha


def _row_grad(row: torch.Tensor, column: int, d_logit: torch.Tensor, need: bool) -> torch.Tensor | None:
    """The gradient of a logit row [B, T, C_i] whose column ``column`` got ``d_logit`` [B, T]."""
    if not need:
        return None
    if row.shape[-1] == 1:
        return d_logit.unsqueeze(-1)
    grad = torch.zeros_like(row)
    grad.select(-1, column).copy_(d_logit)
    return grad


class _MixFromRows(torch.autograd.Function):
    """One call from precomputed logit rows (inputs: the call's column in each row, N, *sources, *rows; row i
    [B, T, C_i] holds source i's logit in C_i calls).

    Forward: ``s_i = rows_i[..., columns_i]``, alpha = softmax(s) (compute dtype), ``h = sum_i alpha_i v_i`` into one
    buffer. Backward (per token, ``delta = sum_j alpha_j dalpha_j``): ``dalpha_i = dh . v_i (+ d alpha_i)``,
    ``ds_i = alpha_i (dalpha_i - delta)`` into column ``columns_i`` of row i's gradient, ``dv_i = alpha_i dh``: no
    gradient through norms or the query here (the rows' own product carries them, once per source).
    Saved: references to the sources and alpha, kept as [N, B, T] (a softmax and sums over a leading dim of a few
    entries run much faster than over a last dim that short); the alpha returned is its [B, T, N] view.

    The sources also come out unchanged (views: ``(h, alpha, *sources)``), for the caller to hand to the next call
    instead of the inputs: then each version of a source has one reader, and the backward returns each source's
    whole gradient, ``alpha_i dh`` plus what came back through its pass-through output, in one fused pass, instead
    of autograd summing one fresh tensor per reading call (every node still returns complete gradients).
    """

    @staticmethod
    def forward(ctx, columns, n_src, *tensors):  # noqa: D102
        sources, rows = tensors[:n_src], tensors[n_src:]
        logits = torch.stack([row.select(-1, j) for row, j in zip(rows, columns)])  # [N, B, T]
        alpha = torch.softmax(logits, dim=0)
        weights = alpha.unsqueeze(-1).unbind(0)  # N contiguous [B, T, 1]
        h = torch.mul(sources[0].to(alpha.dtype), weights[0])
        for v, a in zip(sources[1:], weights[1:]):
            h.addcmul_(v, a)
        ctx.columns, ctx.n_src, ctx.device_type = columns, n_src, sources[0].device.type
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(alpha, *sources, *rows)
        return (h.to(sources[0].dtype), alpha.movedim(0, -1), *sources)

    @staticmethod
    def backward(ctx, grad_h, grad_alpha, *grad_passed):  # noqa: D102
        with torch.autocast(device_type=ctx.device_type, enabled=False):
            return _MixFromRows._backward(ctx, grad_h, grad_alpha, grad_passed)

    @staticmethod
    def _backward(ctx, grad_h, grad_alpha, grad_passed):
        alpha, *tensors = ctx.saved_tensors  # alpha [N, B, T]
        n_src, columns = ctx.n_src, ctx.columns
        sources, rows = tensors[:n_src], tensors[n_src:]
        need = ctx.needs_input_grad[2:]
        if grad_h is None and grad_alpha is None:
            return (None, None, *grad_passed, *([None] * n_src))
        if torch.is_grad_enabled():  # create_graph: differentiate the same function written with autograd's ops
            tensors = local_aliases(tensors)
            sources, rows = tensors[:n_src], tensors[n_src:]
            wanted = [x for x, nd in zip(tensors, need) if nd]
            h, a = _mix_rows_reference(columns, sources, rows)
            outs, grads = [h], [grad_h if grad_h is not None else torch.zeros_like(h)]
            if grad_alpha is not None:
                outs.append(a)
                grads.append(grad_alpha.to(a.dtype))
            found = iter(torch.autograd.grad(outs, wanted, grads, create_graph=True, allow_unused=True))
            found = [next(found) if nd else None for nd in need]
            for i, passed in enumerate(grad_passed):
                if passed is not None and need[i]:
                    found[i] = passed if found[i] is None else found[i] + passed
            return (None, None, *found)
        cd = alpha.dtype
        dh = grad_h.to(cd) if grad_h is not None else None
        scratch = None
        if dh is not None:
            scratch = torch.empty(dh.shape, dtype=cd, device=dh.device)  # one product buffer, reused
            d_alpha = torch.stack([torch.mul(dh, v, out=scratch).sum(dim=-1) for v in sources])  # [N, B, T]
            if grad_alpha is not None:
                d_alpha += grad_alpha.movedim(-1, 0).to(cd)
        else:
            d_alpha = grad_alpha.movedim(-1, 0).to(cd)
        ds = alpha * (d_alpha - (alpha * d_alpha).sum(dim=0))  # [N, B, T]: logit gradients
        grad_sources = [None] * n_src
        if dh is not None:
            weights = alpha.unsqueeze(-1).unbind(0)  # N contiguous [B, T, 1]
            for i in reversed(range(n_src)):
                if not need[i]:
                    continue
                passed, out = grad_passed[i], None
                if scratch is not None and sources[i].dtype == cd:  # the product buffer is free now: reuse it once
                    out, scratch = scratch, None
                if passed is None:
                    grad = torch.mul(dh, weights[i], out=out) if out is not None else torch.mul(dh, weights[i])
                else:  # alpha_i dh + the gradient through the pass-through output, in one pass
                    passed = passed.to(cd)
                    grad = (torch.addcmul(passed, dh, weights[i], out=out) if out is not None
                            else torch.addcmul(passed, dh, weights[i]))
                grad_sources[i] = grad.to(sources[i].dtype)
        else:
            grad_sources = [g if nd else None for g, nd in zip(grad_passed, need)]
        grad_rows = list(map(_row_grad, rows, columns, ds.unbind(0), need[n_src:]))
        return (None, None, *grad_sources, *grad_rows)


def attention_residual_from_rows(
    columns: Sequence[int], sources: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], return_weights: bool,
    pass_sources: bool = False,
):
    """One call over the sources given each source's :func:`source_logit_rows` (the torch backend's path for a
    caller whose calls share sources); the op's values and gradients to floating-point reassociation.

    Args:
        columns: N ints, the call's column in each row. sources: N tensors [B, T, D]. rows: their logit rows
            [B, T, C_i] (compute dtype). return_weights: also return alpha.
        pass_sources: also return the sources as passed through the call (views of the same tensors), for the
            caller's later calls to read instead (see :class:`_MixFromRows`: each source's gradient is then
            formed in one chain of fused passes rather than summed by autograd over its readers).
    Returns:
        h [B, T, D] in the sources' dtype, or ``(h, alpha)`` with alpha [B, T, N] in the compute dtype; with
        ``pass_sources``, ``(that, passed sources)``.
    """
    device_type = sources[0].device.type
    with torch.autocast(device_type=device_type, enabled=False):
        h, alpha, *passed = _MixFromRows.apply(tuple(columns), len(sources), *sources, *rows)
    out = (h, alpha.contiguous()) if return_weights else h  # (the Function's alpha is a view of [N, B, T])
    return (out, tuple(passed)) if pass_sources else out


__all__ = [
    "attention_residual_from_rows",
    "call_keys",
    "parameter_versions",
    "source_logit_rows",
    "uses_logit_rows",
]
