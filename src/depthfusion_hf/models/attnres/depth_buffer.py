"""The AttnRes model's cached-decoding path: a :class:`DepthBuffer` holds the sources of a forward without
gradients over few tokens, and every call's logits, in preallocated buffers reused between forwards, so a
call is a softmax over a row slice and one product (:func:`uses_depth_buffer` says when it applies).

This file must stay self-contained (only ``torch`` and same-folder relative imports): it is copied next to the
model code by ``save_pretrained`` for ``trust_remote_code`` loading.
"""

from __future__ import annotations

import math
import threading

import torch

from .attnres import SMALL_NUMEL, attention_residual_with_backend, compute_dtype
from .shared_sources import parameter_versions


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


__all__ = ["DepthBuffer", "acquire_depth_buffer", "uses_depth_buffer"]
