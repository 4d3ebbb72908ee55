"""The AttnRes model's torch-backend paths for calls that share their sources: each source is scored once, when it
is written, instead of once per call reading it (the op itself, one call at a time, is ``attnres.py``).

- With gradients over many tokens (:func:`uses_logit_rows`, training): :func:`call_keys` takes every call's
  ``u_c = w_c * g_c`` once per forward, :func:`source_logit_rows` gives a written source its logits
  ``r (u_c . v)`` for the calls that read it (one product), and :func:`attention_residual_from_rows` runs a
  call from its sources' rows (softmax, weighted sum; the backward returns ``alpha_i dh`` per source and the
  logit gradients, which reach the sources, queries and norm weights through the rows' products).
- Without gradients over few tokens (:func:`uses_depth_buffer`, cached decoding): a :class:`DepthBuffer` holds
  the sources and every call's logits in preallocated buffers reused between forwards, so a call is a softmax
  over a row slice and one product.

This file must stay self-contained (only ``torch`` and same-folder relative imports): it is copied next to the
model code by ``save_pretrained`` for ``trust_remote_code`` loading.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from .attnres import SMALL_NUMEL, attention_residual_with_backend, compute_dtype, source_inv_rms


def uses_depth_buffer(backend: str, source: torch.Tensor) -> bool:
    """Whether a caller whose calls share sources should keep them in a :class:`DepthBuffer` (cached decoding).

    The buffer is the torch backend's path for forwards without gradients over few tokens: backend
    ``"torch"``, gradients disabled, sources of at most ``SMALL_NUMEL`` elements, a float32 or float64 dtype
    (the buffer holds the sources exactly in their own dtype, which must then be the compute dtype) and no
    autocast (its products would run in half precision).

    Args:
        backend: a resolved backend. source: one source [B, T, D] (all share its shape).
    """
    return (
        backend == "torch"
        and not torch.is_grad_enabled()
        and source.numel() <= SMALL_NUMEL
        and source.dtype in (torch.float32, torch.float64)
        and not torch.is_autocast_enabled(source.device.type)
    )


class DepthBuffer:
    """The AttnRes sources of a forward without gradients over few tokens (cached decoding), and the logit table
    of every call, in preallocated buffers reused from one forward to the next.

    Shapes: M = B T tokens, D hidden, C calls, ``capacity`` sources at most. ``rows`` [capacity, M, D + 1] (the
    sources' dtype) holds source i in ``rows[i, :, :D]``; column D holds the constant ``sqrt(D eps)``, so that
    the norm of a row is ``sqrt(sum v^2 + D eps) = sqrt(D) / r`` with ``r = rsqrt(mean(v^2) + eps)``.
    ``keys`` [C, D + 1] holds ``sqrt(D) w_c * g_c`` of every call c (zero in column D), taken once per forward
    (:meth:`start`). When a source is written (:meth:`write`: appended, or added to the last source, a block's
    running sum) its scaled logit for every call, ``(keys_c . row_i) / |row_i| = r_i (u_c . v_i)``, goes into
    ``logits`` [C, M, capacity]: one product and one norm per write. Call c over the first n sources
    (:meth:`mix`) is then a softmax over ``logits[c, :, :n]`` and one product with the sources: three operators
    instead of the stacked path's copy of every source and ~15 operators. Values are the op's to
    floating-point reassociation.

    The calls must come in the order of the keys; a call whose query or key weight is not the one its key was
    taken from (or that was changed in place since, or whose compute dtype is above the buffer's, or whose eps
    is not the buffer's) runs the torch backend over views of the sources instead. Written sources are never
    handed out (block sums are updated in place); calls return fresh tensors. ``lock`` marks a buffer in use by
    a forward (a concurrent forward makes its own). The buffers are normal tensors even when made under
    ``torch.inference_mode`` (a later forward without it writes them).
    """

    def __init__(self, first: torch.Tensor, capacity: int, num_calls: int, eps: float):
        """Buffers for sources shaped like ``first`` [B, T, D], ``capacity`` sources and ``num_calls`` calls."""
        batch, length, dim = first.shape
        self.shape, self.eps, self.num_calls = first.shape, eps, num_calls
        tokens = batch * length
        options = dict(dtype=first.dtype, device=first.device)
        with torch.inference_mode(False):  # normal tensors: a later forward outside inference mode writes them
            self.rows = torch.empty(capacity, tokens, dim + 1, **options)
            self.rows[:, :, dim].fill_(math.sqrt(dim * eps))
            self.keys = torch.zeros(num_calls, dim + 1, **options)
            self._key_data = self.keys[:, :dim]
            self.logits = torch.empty(num_calls, tokens, capacity, **options)
        self.lock = threading.Lock()
        self.count = self.calls = 0
        self.params: tuple[torch.Tensor, ...] = ()
        self.versions: tuple[int, ...] = ()  # the params' version counters when the keys were taken
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._call_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def fits(self, first: torch.Tensor, capacity: int, num_calls: int, eps: float) -> bool:
        """Whether this buffer serves a forward whose first source is ``first`` (same shape, dtype, device...)."""
        return (first.shape == self.shape and first.dtype == self.rows.dtype and first.device == self.rows.device
                and capacity == self.rows.shape[0] and num_calls == self.num_calls and eps == self.eps)

    def start(self, first: torch.Tensor, queries: list[torch.Tensor], key_norm_weights: list[torch.Tensor]) -> None:
        """Begin a forward: take every call's key (in call order) and write ``first`` [B, T, D] as source 0."""
        self.count = self.calls = 0
        self.params = self._take_keys(queries, key_norm_weights)
        self.versions = parameter_versions(self.params) or ()
        if not self.versions:
            self.params = ()
        self.write(first, new_source=True)

    def _take_keys(self, queries: list[torch.Tensor], key_norm_weights: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Fill ``keys`` and return the parameters they were taken from; ``()`` (no keys: every call takes the
        torch backend) for parameters elsewhere than the buffer or of a wider dtype."""
        if len(queries) != self.num_calls:
            return ()
        try:
            w, g = torch.stack(queries), torch.stack(key_norm_weights)
        except RuntimeError:  # parameters on several devices (e.g. offloaded ones on "meta")
            return ()
        if not (w.device == g.device == self.rows.device and compute_dtype(self.rows.dtype, w, g) == self.rows.dtype):
            return ()
        dtype = self.rows.dtype  # the product in the compute dtype, as the op takes it (not in the params' dtype)
        torch.mul(w.to(dtype), g.to(dtype), out=self._key_data).mul_(math.sqrt(self.shape[-1]))
        return (*queries, *key_norm_weights)

    def write(self, output: torch.Tensor, new_source: bool) -> None:
        """Append ``output`` [B, T, D] as a new source, or add it to the last one (a block's running sum)."""
        if new_source:
            self.count += 1
        row, data, logit_column = self._slot(self.count - 1)
        flat = output.reshape(data.shape)
        if new_source:
            data.copy_(flat)
        else:
            data.add_(flat)
        dots = torch.mv(self.keys, row) if row.dim() == 1 else torch.mm(self.keys, row.t())  # [C] or [C, M]
        torch.div(dots, torch.linalg.vector_norm(row, dim=-1), out=logit_column)

    def _slot(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of source i: its row [M, D + 1], its data [M, D] and its logit column [C, M] (M = 1: no M dim)."""
        if i not in self._slots:
            row, column = self.rows[i], self.logits[:, :, i]
            if row.shape[0] == 1:
                row, column = row[0], column[:, 0]
            self._slots[i] = (row, row[..., : self.shape[-1]], column)
        return self._slots[i]

    def _views(self, call: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views for call ``call`` over n sources: its logits and the sources, [n] and [D, n] (M = 1) or
        [M, n] and [M, n, D]."""
        key = (call, n)
        if key not in self._call_views:
            logits, sources = self.logits[call, :, :n], self.rows[:n, :, : self.shape[-1]]
            if sources.shape[1] == 1:
                logits, sources = logits[0], sources[:, 0].t()
            else:
                sources = sources.transpose(0, 1)
            self._call_views[key] = (logits, sources)
        return self._call_views[key]

    def _key_is_current(self, call: int, query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float) -> bool:
        """Whether call ``call``'s logits in the table are its own: its key was taken from these very parameters,
        unchanged since (version counters), and its eps is the buffer's."""
        if not self.params or call >= self.num_calls or eps != self.eps:
            return False
        j = self.num_calls + call
        return (query is self.params[call] and key_norm_weight is self.params[j]
                and query._version == self.versions[call] and key_norm_weight._version == self.versions[j])

    def sources(self) -> list[torch.Tensor]:
        """The current sources as views [B, T, D] (valid until the next write)."""
        return [self._slot(i)[1].view(self.shape) for i in range(self.count)]

    def mix(
        self, query: torch.Tensor, key_norm_weight: torch.Tensor, return_weights: bool = False,
        eps: float | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The next AttnRes call over the current sources.

        Args:
            query: [D] (the call's ``w``). key_norm_weight: [D] (``g``). return_weights: also return alpha.
            eps: the call's RMSNorm epsilon (None: the buffer's).
        Returns:
            h [B, T, D] (the sources' dtype), or ``(h, alpha)`` with alpha [B, T, n] in that dtype.
        """
        call, n = self.calls, self.count
        self.calls += 1
        eps = self.eps if eps is None else eps
        if not self._key_is_current(call, query, key_norm_weight, eps):
            return attention_residual_with_backend(query, self.sources(), key_norm_weight, eps, return_weights,
                                                   "torch")
        logits, sources = self._views(call, n)
        alpha = torch.softmax(logits, dim=-1)  # [M, n], or [n] for one token
        if sources.dim() == 2:  # one token: [D, n] @ [n]
            h = torch.mv(sources, alpha).view(self.shape)
        else:
            h = torch.matmul(alpha.unsqueeze(1), sources).view(self.shape)
        return (h, alpha.view(*self.shape[:2], n)) if return_weights else h


def acquire_depth_buffer(
    pool: list[DepthBuffer], first: torch.Tensor, capacity: int, num_calls: int, eps: float
) -> DepthBuffer:
    """A :class:`DepthBuffer` from ``pool`` (a caller's list, kept between forwards) that fits and is free, else a
    new one added to it; returned locked (release ``buffer.lock`` when the forward ends).

    Args:
        pool: the caller's buffers. first: the first source [B, T, D]. capacity: the most sources.
        num_calls: the number of calls per forward. eps: the calls' RMSNorm epsilon.
    """
    for buffer in pool:
        if buffer.fits(first, capacity, num_calls, eps) and buffer.lock.acquire(blocking=False):
            return buffer
    buffer = DepthBuffer(first, capacity, num_calls, eps)
    buffer.lock.acquire()
    pool[:] = [b for b in pool if b.lock.locked()][-3:] + [buffer]  # drop idle buffers of other shapes
    return buffer


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


def source_logit_rows(source: torch.Tensor, keys: torch.Tensor, eps: float) -> torch.Tensor:
    """A source's logit in every call, computed once when the source is written: ``r (u_c . v)`` for each c.

    One [M, D] x [D, C] product per source replaces one dot product per call reading it; its gradient reaches
    the source and the keys through two products per source (not one accumulation per call).

    Args:
        source: v [B, T, D]. keys: [C, D] from :func:`call_keys`, or the rows of the calls that read this source.
        eps: the calls' RMSNorm epsilon.
    Returns:
        [B, T, C] in the keys' dtype (the compute dtype: float32, float64 for float64 inputs), differentiable.
    """
    with torch.autocast(device_type=source.device.type, enabled=False):  # the logits stay in the compute dtype
        cd = torch.promote_types(source.dtype, keys.dtype)
        inv_rms = source_inv_rms(source, eps).to(cd)
        return torch.matmul(source.to(cd), keys.to(cd).t()) * inv_rms.unsqueeze(-1)


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
    Saved: references to the sources and alpha [B, T, N].
    """

    @staticmethod
    def forward(ctx, columns, n_src, *tensors):  # noqa: D102
        sources, rows = tensors[:n_src], tensors[n_src:]
        logits = torch.stack([row.detach()[..., j] for row, j in zip(rows, columns)], dim=-1)
        alpha = torch.softmax(logits, dim=-1)
        h = torch.mul(sources[0].detach().to(alpha.dtype), alpha[..., 0:1])
        for i in range(1, n_src):
            h.addcmul_(sources[i].detach(), alpha[..., i : i + 1])
        ctx.columns, ctx.n_src, ctx.device_type = columns, n_src, sources[0].device.type
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(alpha, *sources, *rows)
        return h.to(sources[0].dtype), alpha

    @staticmethod
    def backward(ctx, grad_h, grad_alpha):  # noqa: D102
        with torch.autocast(device_type=ctx.device_type, enabled=False):
            return _MixFromRows._backward(ctx, grad_h, grad_alpha)

    @staticmethod
    def _backward(ctx, grad_h, grad_alpha):
        alpha, *tensors = ctx.saved_tensors
        n_src, columns = ctx.n_src, ctx.columns
        sources, rows = tensors[:n_src], tensors[n_src:]
        need = ctx.needs_input_grad[2:]
        if grad_h is None and grad_alpha is None:
            return (None, None, *([None] * 2 * n_src))
        if torch.is_grad_enabled():  # create_graph: differentiate the same function written with autograd's ops
            wanted = [x for x, nd in zip(tensors, need) if nd]
            h, a = _mix_rows_reference(columns, sources, rows)
            outs, grads = [h], [grad_h if grad_h is not None else torch.zeros_like(h)]
            if grad_alpha is not None:
                outs.append(a)
                grads.append(grad_alpha.to(a.dtype))
            found = iter(torch.autograd.grad(outs, wanted, grads, create_graph=True, allow_unused=True))
            return (None, None, *[next(found) if nd else None for nd in need])
        cd = alpha.dtype
        dh = grad_h.to(cd) if grad_h is not None else None
        if dh is not None:
            scratch = torch.empty(dh.shape, dtype=cd, device=dh.device)  # one product buffer, reused
            d_alpha = torch.stack([torch.mul(dh, v, out=scratch).sum(dim=-1) for v in sources], dim=-1)
            if grad_alpha is not None:
                d_alpha += grad_alpha.to(cd)
        else:
            d_alpha = grad_alpha.to(cd)
        ds = alpha * (d_alpha - (alpha * d_alpha).sum(dim=-1, keepdim=True))  # [B, T, N]: logit gradients
        grad_sources = [
            torch.mul(dh, alpha[..., i : i + 1]).to(v.dtype) if need[i] and dh is not None else None
            for i, v in enumerate(sources)
        ]
        grad_rows = list(map(_row_grad, rows, columns, ds.unbind(-1), need[n_src:]))
        return (None, None, *grad_sources, *grad_rows)


def attention_residual_from_rows(
    columns: Sequence[int], sources: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], return_weights: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One call over the sources given each source's :func:`source_logit_rows` (the torch backend's path for a
    caller whose calls share sources); the op's values and gradients to floating-point reassociation.

    Args:
        columns: N ints, the call's column in each row. sources: N tensors [B, T, D]. rows: their logit rows
            [B, T, C_i] (compute dtype). return_weights: also return alpha.
    Returns:
        h [B, T, D] in the sources' dtype, or ``(h, alpha)`` with alpha [B, T, N] in the compute dtype.
    """
    device_type = sources[0].device.type
    with torch.autocast(device_type=device_type, enabled=False):
        h, alpha = _MixFromRows.apply(tuple(columns), len(sources), *sources, *rows)
    return (h, alpha) if return_weights else h


__all__ = [
    "DepthBuffer",
    "acquire_depth_buffer",
    "attention_residual_from_rows",
    "call_keys",
    "parameter_versions",
    "source_logit_rows",
    "uses_depth_buffer",
    "uses_logit_rows",
]
