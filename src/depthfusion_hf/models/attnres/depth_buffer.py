"""The AttnRes model's cached-decoding path: a :class:`DepthBuffer` holds the sources of a forward without
gradients over few tokens, with their normalised keys, in preallocated buffers reused between forwards, so a
call is one fused attention operator (:func:`uses_depth_buffer` says when it applies).

This file must stay self-contained (only ``torch`` and same-folder relative imports): it is copied next to the
model code by ``save_pretrained`` for ``trust_remote_code`` loading.
"""

from __future__ import annotations

import math
import threading

import torch
from torch.nn import functional as F

from .attnres import SMALL_NUMEL, attention_residual_with_backend, compute_dtype
from .shared_sources import parameter_versions


def uses_depth_buffer(backend: str, source: torch.Tensor) -> bool:
    """Whether a caller whose calls share sources should keep them in a :class:`DepthBuffer` (cached decoding).

    The buffer is the torch backend's path for forwards without gradients over few tokens: backend
    ``"torch"``, gradients disabled, sources of at most ``SMALL_NUMEL`` elements, a float32 or float64 dtype
    (the buffer holds the sources exactly in their own dtype, which must then be the compute dtype), no
    autocast (its products would run in half precision), and not while ``torch.compile`` traces the model (the
    buffer is state kept between forwards, with a lock and cached views, which dynamo cannot capture).

    Args:
        backend: a resolved backend. source: one source [B, T, D] (all share its shape).
    """
    return (
        backend == "torch"
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and source.numel() <= SMALL_NUMEL
        and source.dtype in (torch.float32, torch.float64)
        and not torch.is_autocast_enabled(source.device.type)
    )


class DepthBuffer:
    """The AttnRes sources of a forward without gradients over few tokens (cached decoding), kept so that a call is
    one fused attention operator, in preallocated buffers reused from one forward to the next.

    A call is ``sum_i softmax_i(w . RMSNorm_g(v_i)) v_i = sum_i softmax_i(u . k_i) v_i`` with the call's key
    ``u = sqrt(D) w * g`` and the source's normalised key ``k_i = v_i / sqrt(sum v_i^2 + D eps)`` (so
    ``u . k_i = r_i (w * g) . v_i``, ``r_i = rsqrt(mean(v_i^2) + eps)``): scaled dot-product attention with
    one query, the sources' keys and the sources as values, per token.

    Shapes: M = B T tokens, D hidden, C calls, ``capacity`` sources at most. ``values`` [capacity, M, D + 1]
    (the sources' dtype) holds source i in ``values[i, :, :D]``; column D holds the constant ``sqrt(D eps)``,
    so that one vector norm of a row is ``sqrt(sum v^2 + D eps)``. ``keys`` [capacity, M, D] holds the
    normalised keys ``k_i``, ``queries`` [C, D] every call's ``u``, taken once per forward (:meth:`start`).
    Writing a source (:meth:`write`: appended,
    or added to the last source, a block's running sum) is three operators (copy or add, norm, division);
    call c over the first n sources (:meth:`mix`) is one ``scaled_dot_product_attention`` over views. Values
    are the op's to floating-point reassociation.

    The calls must come in the order of the queries; a call whose query or key weight is not the one its key
    was taken from (or that was changed in place since, or whose compute dtype is above the buffer's, or
    whose eps is not the buffer's) runs the torch backend over views of the sources instead. Written sources
    are never handed out (block sums are updated in place); calls return fresh tensors. ``lock`` marks a
    buffer in use by a forward (a concurrent forward makes its own). The buffers are normal tensors even when
    made under ``torch.inference_mode`` (a later forward without it writes them).
    """

    def __init__(self, first: torch.Tensor, capacity: int, num_calls: int, eps: float):
        """Buffers for sources shaped like ``first`` [B, T, D], ``capacity`` sources and ``num_calls`` calls."""
        batch, length, dim = first.shape
        self.shape, self.eps, self.num_calls = first.shape, eps, num_calls
        tokens = batch * length
        options = dict(dtype=first.dtype, device=first.device)
        with torch.inference_mode(False):  # normal tensors: a later forward outside inference mode writes them
            self.values = torch.empty(capacity, tokens, dim + 1, **options)
            self.values[:, :, dim].fill_(math.sqrt(dim * eps))
            self.keys = torch.empty(capacity, tokens, dim, **options)
            self.queries = torch.zeros(num_calls, dim, **options)
        self.lock = threading.Lock()
        self.count = self.calls = 0
        self.params: tuple[torch.Tensor, ...] = ()
        self.versions: tuple[int, ...] = ()  # the params' version counters when the keys were taken
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._call_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def fits(self, first: torch.Tensor, capacity: int, num_calls: int, eps: float) -> bool:
        """Whether this buffer serves a forward whose first source is ``first`` (same shape, dtype, device...)."""
        return (first.shape == self.shape and first.dtype == self.values.dtype and first.device == self.values.device
                and capacity == self.values.shape[0] and num_calls == self.num_calls and eps == self.eps)

    def start(self, first: torch.Tensor, queries: list[torch.Tensor], key_norm_weights: list[torch.Tensor]) -> None:
        """Begin a forward: take every call's key (in call order) and write ``first`` [B, T, D] as source 0."""
        self.count = self.calls = 0
        # taken again every forward: a change through ``param.data`` between forwards bumps no version counter
        self.params = self._take_keys(queries, key_norm_weights)
        self.versions = parameter_versions(self.params) or ()
        if not self.versions:
            self.params = ()
        self.write(first, new_source=True)

    def _take_keys(self, queries: list[torch.Tensor], key_norm_weights: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Fill ``queries`` and return the parameters they were taken from; ``()`` (no keys: every call takes the
        torch backend) for parameters elsewhere than the buffer or of a wider dtype."""
        if len(queries) != self.num_calls:
            return ()
        try:
            w, g = torch.stack(queries), torch.stack(key_norm_weights)
        except RuntimeError:  # parameters on several devices (e.g. offloaded ones on "meta")
            return ()
        if not (w.device == g.device == self.values.device
                and compute_dtype(self.values.dtype, w, g) == self.values.dtype):
            return ()
        dtype = self.values.dtype  # the product in the compute dtype, as the op takes it (not in the params' dtype)
        torch.mul(w.to(dtype), g.to(dtype), out=self.queries).mul_(math.sqrt(self.shape[-1]))
        return (*queries, *key_norm_weights)

    def write(self, output: torch.Tensor, new_source: bool) -> None:
        """Append ``output`` [B, T, D] as a new source, or add it to the last one (a block's running sum)."""
        if new_source:
            self.count += 1
        row, data, key = self._slot(self.count - 1)
        if new_source:
            data.copy_(output)
        else:
            data.add_(output)
        torch.div(data, torch.linalg.vector_norm(row, dim=-1, keepdim=True), out=key)

    def _slot(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views [B, T, .] of source i: its row (with the constant column) [.., D + 1], its data and its key [.., D]."""
        if i not in self._slots:
            batch, length, dim = self.shape
            row = self.values[i].view(batch, length, dim + 1)
            self._slots[i] = (row, row[..., :dim], self.keys[i].view(batch, length, dim))
        return self._slots[i]

    def _views(self, call: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views for call ``call`` over n sources, as scaled_dot_product_attention takes them: its query
        [M, 1, 1, D], the sources' keys and the sources [M, 1, n, D]."""
        if (call, n) not in self._call_views:
            tokens, dim = self.values.shape[1], self.shape[-1]
            query = self.queries[call].view(1, 1, 1, dim).expand(tokens, 1, 1, dim)
            keys = self.keys[:n].transpose(0, 1).unsqueeze(1)
            values = self.values[:n, :, :dim].transpose(0, 1).unsqueeze(1)
            self._call_views[(call, n)] = (query, keys, values)
        return self._call_views[(call, n)]

    def _key_is_current(self, call: int, query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float) -> bool:
        """Whether call ``call``'s query in the buffer is its own: taken from these very parameters, unchanged
        since (version counters), and its eps is the buffer's."""
        if not self.params or call >= self.num_calls or eps != self.eps:
            return False
        j = self.num_calls + call
        return (query is self.params[call] and key_norm_weight is self.params[j]
                and query._version == self.versions[call] and key_norm_weight._version == self.versions[j])

    def sources(self) -> list[torch.Tensor]:
        """The current sources as views [B, T, D] (valid until the next write)."""
        return [self._slot(i)[1] for i in range(self.count)]

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
        u, keys, values = self._views(call, n)
        if not return_weights:
            return F.scaled_dot_product_attention(u, keys, values, scale=1.0).view(self.shape)
        alpha = torch.softmax(torch.matmul(keys, u.transpose(-1, -2)).squeeze(-1), dim=-1)  # [M, 1, n]
        h = torch.matmul(alpha.unsqueeze(-2), values).view(self.shape)
        return h, alpha.view(*self.shape[:2], n)


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
