"""The depth stream of one MoDA forward pass: entries written once, read in place, gradients accumulated once.

A MoDA layer ``l`` reads the depth entries that layers ``0 .. l-1`` wrote for the same token. Passing
them as a tuple and stacking them per layer (``torch.stack`` into a fresh ``[B, Hkv, T, M_l, d]``)
copies ``O(L^2)`` entries per forward, and in the backward every reading layer returns its own
``[.., M_l, d]`` gradient that autograd then sums per entry. :class:`DepthStream` removes both:

- **Forward.** Entry ``m`` is written once (:meth:`DepthStream.write`) and layer ``l`` reads its window
  of entries ``[start, stop)`` in place (:meth:`DepthStream.attend`). On the CPU fast path (fp32 / fp64,
  ``torch`` backend) the entries are kept as the tensors the layers wrote (no buffer, no copy) and read
  as [N, d] row views, one fused product per entry. Elsewhere (Triton, half precision) they are copied
  into one slot-major buffer per pool, ``keys`` / ``values`` [M_max, B, T, Hkv, d], read as strided
  [B, Hkv, T, M, d] views by the op. A slot is never written again after it has been read.
- **Backward.** An entry's gradient is formed once, when the backward reaches the layer that wrote it:
  on the fast path from its readers' stored ``q``, ``dO``, ``P``, ``dS`` (one multiply-add per reader);
  elsewhere each reader adds its depth gradient in place into a stream-owned gradient buffer and the
  writer hands its slot on. No per-entry autograd sums, no per-reader graph edges.

Autograd safety (entries are read by later layers' backward after the writer's forward returned, and a
buffer is written in place after earlier layers saved views of it): the stream's tensors are not
autograd tensors. Two custom Functions own them for the whole pass:

- :class:`_StreamWrite` stores an entry and returns a new, empty "token" tensor that depends on the
  previous token;
- :class:`_StreamRead` (the attention of one layer) takes the latest token as an input.

So every reader of entry ``m`` consumes a token produced at or after write ``m``, and the writer's
backward (which needs every reader's contribution) can run only after the backward of each reader
that depends on its token: the ordering is enforced by the graph, not by hope. A buffer's saved views
are never checked against its version counter, which is sound because a slot is final once read; an
entry kept by reference that is changed in place before the backward raises (its version is checked).
Under gradient checkpointing (a recomputed layer would write again) the model uses the tuple
path instead (see ``modeling_moda``).

Without gradients (inference) the same storage is used with no Function at all, with the backend
resolved once per forward pass. A one-token decoding step runs each layer as one SDPA call over
``[sequence keys | its depth entries]`` concatenated.

This file must stay self-contained (only ``torch`` and same-folder relative imports): it is copied
next to the model code by ``save_pretrained`` for ``trust_remote_code`` loading.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.nn import functional as F

from .moda_attention import (
    _FLASH_CPU,
    _FLASH_CPU_BACKWARD,
    _flash_cpu_applies,
    _sequence_mask,
    _unit_stride_last,
    moda_attention_with_backend,
    moda_backward_from,
    moda_forward_saving,
)

# The stream's own CPU path: SDPA's fused flash kernel for the sequence pool (as in ``moda_attention``'s
# CPU path) and the depth pool as one fused product per entry over the N = B * Hkv * T tokens, reading the
# entries' rows in place. Half precision takes the generic path.
FAST_CPU_DTYPES = (torch.float32, torch.float64)


def _fast_cpu_applies(q: torch.Tensor, attention_mask: torch.Tensor | None, backend: str) -> bool:
    return backend == "torch" and q.dtype in FAST_CPU_DTYPES and _flash_cpu_applies(q, attention_mask)


def _to_rows(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, T, *rest] -> [N, G, *rest]: N = B * T * Hkv tokens in (batch, position, KV head) order, G = Hq / Hkv.

    A view for the tensors the layer hands over, which are laid out [B, T, Hq, ...] in memory (the projections'
    queries, SDPA's outputs, log-sum-exps and gradients); the depth slots use the same token order.
    """
    batch, num_q_heads, tokens, *rest = x.shape
    return x.transpose(1, 2).reshape(batch * tokens * num_kv_heads, num_q_heads // num_kv_heads, *rest)


def _from_rows(x: torch.Tensor, batch: int, num_kv_heads: int, tokens: int) -> torch.Tensor:
    """[N, G, d] -> [B, Hq, T, d], a view laid out [B, T, Hq, d] in memory (inverse of :func:`_to_rows`)."""
    group, head_dim = x.shape[1], x.shape[2]
    return x.view(batch, tokens, num_kv_heads * group, head_dim).transpose(1, 2)


def _entry_rows(entry: torch.Tensor) -> torch.Tensor:
    """An entry [B, Hkv, T, d] as rows [N, d] in the token order of :func:`_to_rows`: a view for the entries a layer
    writes (laid out [B, T, Hkv, d] in memory, rows possibly strided), a copy otherwise."""
    return entry.transpose(1, 2).reshape(-1, entry.shape[-1])


def _token_view(slots: torch.Tensor) -> torch.Tensor:
    """Slot-major slots [M, B, T, Hkv, d] as the op's depth layout [B, Hkv, T, M, d] (a view, no copy)."""
    return slots.permute(1, 3, 2, 0, 4)


def _depth_dots(x: torch.Tensor, slots, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token dot products with a window of entries: ``out[m, n, g] = x[n, g] . slots[m][n]``.

    Args:
        x: [N, G, d]; slots: M entries, each [N, d] (any row stride: views of the entries as written);
        out: [M, N, G], written and returned; scratch: None or a contiguous [N, G, d] buffer for the products.
    One product and one sum per entry, streaming its rows once (the entries are separate tensors, so there is no
    batched product to take; CPU ``bmm`` on such tiny per-token matrices is no faster), into one product buffer:
    ``linalg.vecdot`` would allocate a fresh one per entry, and fresh memory costs page faults on every step.
    """
    if scratch is None:
        scratch = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for m, slot in enumerate(slots):
        torch.sum(torch.mul(x, slot.unsqueeze(1), out=scratch), dim=-1, out=out[m])
    return out


def _depth_mix(weights: torch.Tensor, slots, out: torch.Tensor) -> torch.Tensor:
    """``out[n, g] += sum_m weights[m, n, g] slots[m][n]`` in place, one fused multiply-add per entry.

    Args:
        weights: [M, N, G]; slots: M entries, each [N, d]; out: [N, G, d], accumulated into and returned.
    """
    for m, slot in enumerate(slots):
        out.addcmul_(slot.unsqueeze(1), weights[m].unsqueeze(-1))
    return out


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gradients of half-precision entries are summed over their readers in float32 and rounded once."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _detached(saved):
    """``saved`` with every tensor detached, so that the Function's ctx does not keep its own output alive
    through the output's ``grad_fn`` (a reference cycle that only the garbage collector would break)."""
    if isinstance(saved, torch.Tensor):
        return saved.detach()
    if dataclasses.is_dataclass(saved) and not isinstance(saved, type):
        return dataclasses.replace(saved, **{f.name: _detached(getattr(saved, f.name))
                                             for f in dataclasses.fields(saved) if f.init})
    if isinstance(saved, tuple):
        return tuple(_detached(x) for x in saved)
    return saved


def _first_order_only(backward):
    """``once_differentiable`` that refuses a backward with ``create_graph=True`` instead of answering it.

    ``once_differentiable`` alone hands back gradients that are cut off from the graph: a later
    ``torch.autograd.grad`` w.r.t. the parameters then silently leaves out every second-order term through the
    stream (its error node is pruned, not run). The stream's backward is first order only, so it says so.
    """

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "MoDA's depth stream computes first-order gradients only; got a backward with create_graph=True "
                "(higher-order gradients). For them run the forward on the tuple path with the reference backend: "
                "DEPTHFUSION_BACKEND=reference"
            )
        return backward(ctx, *grads)

    return wrapper


class _StreamWrite(torch.autograd.Function):
    """Copy one entry (key, value [B, Hkv, T, d]) into its slot; return the next ordering token (empty)."""

    @staticmethod
    def forward(ctx, stream: DepthStream, slot: int, token: torch.Tensor | None, key, value):  # noqa: D102
        stream.store(slot, key, value)
        ctx.stream, ctx.slot, ctx.has_token = stream, slot, token is not None
        ctx.key_dtype, ctx.value_dtype = key.dtype, value.dtype
        return key.new_empty(0)

    @staticmethod
    @_first_order_only
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_token):  # noqa: D102
        # Every reader of this slot consumed a token that depends on ours, so all of them have run their
        # backward by now: the entry's whole gradient can be formed.
        grad_key, grad_value = ctx.stream.entry_gradient(ctx.slot)
        token_grad = grad_token.new_zeros(0) if ctx.has_token else None
        return None, None, token_grad, grad_key.to(ctx.key_dtype), grad_value.to(ctx.value_dtype)


class _StreamRead(torch.autograd.Function):
    """One layer's MoDA attention over slots ``[start, stop)`` of the stream (see :meth:`DepthStream.attend`)."""

    @staticmethod
    def forward(ctx, stream: DepthStream, reader: int, start: int, stop: int, attention_mask,  # noqa: D102
                scale: float, token: torch.Tensor | None, q, k, v):
        depth = stream.needs_grad(start, stop)
        if stream.fast:
            out, saved = stream.fast_forward(q, k, v, attention_mask, scale, start, stop)
            # Through save_for_backward, so that autograd frees them after this backward (unless the graph is retained)
            ctx.save_for_backward(*saved[:6], *saved[9:])  # q, k, v, out, lse, alpha (None without entries), probs
            ctx.saved = (None,) * 6 + saved[6:9]  # mask, is_causal, scale
        else:
            depth_k, depth_v = stream.window(start, stop)
            out, saved = moda_forward_saving(q, k, v, depth_k, depth_v, attention_mask, scale, True, stream.backend)
            ctx.saved = _detached(saved)
        ctx.stream, ctx.reader, ctx.start, ctx.stop, ctx.has_token = stream, reader, start, stop, token is not None
        ctx.depth_needs_grad = depth
        return out

    @staticmethod
    @_first_order_only
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        stream: DepthStream = ctx.stream
        depth = ctx.depth_needs_grad and ctx.stop > ctx.start
        needs = tuple(ctx.needs_input_grad[7:10])
        if stream.fast:
            tensors = ctx.saved_tensors
            saved = (*tensors[:6], *ctx.saved[6:], *tensors[6:])
            grad_q, grad_k, grad_v = stream.fast_backward(saved, grad_out, needs, ctx.reader if depth else None,
                                                          ctx.start, ctx.stop)
        else:
            into = None
            if depth:
                grad_keys, grad_values = stream.gradient_buffers()
                into = (_token_view(grad_keys[ctx.start:ctx.stop]), _token_view(grad_values[ctx.start:ctx.stop]))
            grad_q, grad_k, grad_v, _, _ = moda_backward_from(ctx.saved, grad_out, needs + (False, False), into)
        token_grad = grad_out.new_zeros(0) if ctx.has_token else None
        return None, None, None, None, None, None, token_grad, grad_q, grad_k, grad_v


class DepthStream:
    """The depth entries of one forward pass: kept as written (CPU fast path) or in two slot-major buffers.

    Args:
        capacity: M_max, the number of entries the pass writes (slots ``0 .. M_max-1``, write order).
        num_readers: how many :meth:`attend` calls (layers) the pass makes.
        backend: a backend already resolved by ``resolve_backend``.
        track_grad: record the writes and reads for autograd; only where ``moda_saving_supported`` holds
            for the pass's inputs (the caller decides, see ``modeling_moda``). Without it the stream
            must only be used without gradients.

    Attributes:
        keys, values: [M_max, B, T, Hkv, d], allocated by the first :meth:`attend` off the fast path (from its
            ``k``'s heads, head size, dtype and device, so a tensor-parallel shard gets its own heads); slot ``m``
            holds entry ``m`` once written. None on the fast path, which keeps the entries as written (each
            [B, Hkv, T, d], detached) and reads them as [N, d] rows; one-token decoding concatenates a reader's
            entries behind its sequence keys (:meth:`decode_step`).
        fast: the stream's own CPU path runs the attention (fp32 / fp64 with the ``torch`` backend);
            otherwise ``moda_attention``'s functional API does (Triton, half precision).

    Gradients of the entries. On the fast path each reader's backward keeps its queries ``q`` [N, G, d],
    output gradient ``dO`` [N, G, d] (N = B Hkv T tokens), depth probabilities ``P`` and logit gradients
    ``dS`` [M, N, G] (references, no copies); the writer of slot ``m`` then forms the entry's gradient over
    its readers r, ``dK_m = sum_r dS_r[m] q_r`` and ``dV_m = sum_r P_r[m] dO_r``, one fused multiply-add per
    reader. On the generic path each reader adds its ``[.., M, d]`` gradients in place into a stream-owned
    gradient buffer (``depth_grads_into``) and the writer hands its slot on.

    Example::

        stream = DepthStream(capacity=4, num_readers=3, backend="torch", track_grad=True)
        out = stream.attend(q, k, v, mask, scale, start=0, stop=0)   # layer 0: no depth entry
        stream.write(0, k0, v0); stream.write(1, fk0, fv0)            # its attention and FFN entries
        out = stream.attend(q1, k1, v1, mask, scale, start=0, stop=2)  # layer 1 reads both
        stream.close()
    """

    def __init__(self, capacity: int, num_readers: int, backend: str, track_grad: bool):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._allocated = False
        self.capacity = capacity
        self.num_readers = num_readers
        self.backend = backend
        self.track_grad = track_grad
        self.fast = False
        self.written = 0
        self.reads = 0
        self._entry_grad = [False] * capacity  # per slot: the entry was written with autograd tracking
        self._readers_of: list[list[int]] = [[] for _ in range(capacity)]  # per slot: the tracked readers
        self._token: torch.Tensor | None = None
        self._grads: tuple[torch.Tensor, torch.Tensor] | None = None
        # Fast path, per reader (kept by its backward until the writer of its first slot has run): its queries
        # q [N, G, d], depth probabilities P [M, N, G], window start, depth-logit gradient dS [M, N, G] and output
        # gradient dO [N, G, d].
        self._reader_backward: dict[int, tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor]] = {}
        self._scratch: torch.Tensor | None = None  # [N, G, d], reused by every layer (see :meth:`scratch`)
        self._masks: dict[int, tuple] = {}
        self._reset_queued = False
        # The fast path keeps the entries as they were written (detached, no buffer, no copy): [B, Hkv, T, d] each,
        # with their row views [N, d] for the depth products (made when first read: one-token decoding concatenates
        # the entries behind its sequence keys instead, see :meth:`decode_step`) and their versions at the write.
        self._entry_lists: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._entry_rows: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._entry_versions: list[tuple[int, int]] = []
        self._one_token = False

    def _allocate(self, q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        self.shape = (q.shape[0], k.shape[1], q.shape[2], self.capacity, k.shape[3])  # (B, Hkv, T, M_max, d), logical
        self.dtype, self.device = k.dtype, k.device
        self.fast = _fast_cpu_applies(q, attention_mask, self.backend)
        self._allocated = True
        if self.fast:
            self._entry_lists = ([], [])
            self._one_token = not self.track_grad and q.shape[2] == 1 and attention_mask is None
            return
        slot_major = (self.capacity, q.shape[0], q.shape[2], k.shape[1], k.shape[3])  # (M_max, B, T, Hkv, d)
        self.keys = k.new_empty(slot_major)
        self.values = k.new_empty(slot_major)

    def write(self, slot: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write entry ``slot``: ``key``, ``value`` [B, Hkv, T, d] are kept (fast path) or copied once into the buffers.

        Slots are written in order (``slot == written``). Writing a slot again is allowed only as the
        recomputation of gradient checkpointing: the values are copied without autograd tracking (all
        readers of that slot have run their backward by then, and the recomputed graph is discarded).
        """
        if not self._allocated or slot > self.written or slot >= self.capacity:
            raise RuntimeError(
                f"DepthStream: entry {slot} written out of order ({self.written} of {self.capacity} slots written)"
            )
        if self._one_token:  # no backward, no products: the entries as they are, at a decode step's cost
            if slot == self.written:
                self._entry_lists[0].append(key)
                self._entry_lists[1].append(value)
                self.written += 1
            return
        track = self.track_grad and torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)
        if track and slot < self.written and not self._entry_grad[slot]:
            # written without gradients, now with: a layer recomputed by reentrant checkpointing, whose forward ran
            # under no_grad; the later layers' gradients through this entry were not tracked (they would be lost)
            raise RuntimeError(
                f"MoDA's depth stream: entry {slot} was written without gradients and is now written again with "
                "them: a layer under reentrant activation checkpointing applied from outside the model (its "
                "forward ran without gradients, so the gradients through its depth entries would be lost). Use "
                "model.gradient_checkpointing_enable() (the model then passes the entries as the layers' "
                "outputs), or non-reentrant checkpointing (use_reentrant=False)"
            )
        if track and slot == self.written:
            self._token = _StreamWrite.apply(self, slot, self._token, key, value)
        else:
            with torch.no_grad():
                self.store(slot, key, value)
        if slot == self.written:
            self._entry_grad[slot] = track
            self.written += 1

    def store(self, slot: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep entry ``slot`` (key, value [B, Hkv, T, d]): by reference on the fast path, else copied into its slot.

        On the fast path a slot written again (a recomputation) keeps its first tensors, which hold the same values.
        """
        if self._entry_lists is None:
            self.keys[slot].copy_(key.transpose(1, 2))  # (B, T, Hkv, d): the token order of the slots
            self.values[slot].copy_(value.transpose(1, 2))
            return
        if slot < len(self._entry_lists[0]):
            return
        key, value = key.detach(), value.detach()
        self._entry_lists[0].append(key)
        self._entry_lists[1].append(value)
        self._entry_versions.append((key._version, value._version))

    def _check_versions(self, start: int, stop: int) -> None:
        """Raise if an entry in ``[start, stop)`` was modified in place after it was written (its saved values for
        the backward would be stale), as autograd does for its own saved tensors."""
        for slot in range(start, stop):
            key, value = self._entry_lists[0][slot], self._entry_lists[1][slot]
            if (key._version, value._version) != self._entry_versions[slot]:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: MoDA depth entry {slot} (a layer's key or value) was changed after it was written"
                )

    def close(self) -> None:
        """End of the forward pass: drop the ordering token (the graph keeps what the backward needs)."""
        self._token = None

    def window(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``[start, stop)`` as views ``depth_k``, ``depth_v`` [B, Hkv, T, stop - start, d] (no copy)."""
        if not self._allocated or not 0 <= start <= stop <= self.written:
            raise RuntimeError(f"DepthStream: window [{start}, {stop}) outside the {self.written} written slots")
        if self._entry_lists is not None:  # the fast path keeps no buffer: a stacked copy (only analysis reads it)
            if stop == start:
                empty = torch.empty(*self.shape[:3], 0, self.shape[4], dtype=self.dtype, device=self.device)
                return empty, empty
            return tuple(torch.stack(entries[start:stop], dim=3) for entries in self._entry_lists)
        return _token_view(self.keys[start:stop]), _token_view(self.values[start:stop])

    def needs_grad(self, start: int, stop: int) -> bool:
        """Whether any entry in slots ``[start, stop)`` was written with autograd tracking."""
        return any(self._entry_grad[start:stop])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None,
               scale: float, start: int, stop: int) -> torch.Tensor:
        """MoDA attention of one layer over its sequence pool and the depth slots ``[start, stop)``.

        Args:
            q: [B, Hq, T, d]; k, v: [B, Hkv, S, d] (cache included); attention_mask as for ``moda_attention``
                (the same mask object for every layer of the pass).
        Returns:
            [B, Hq, T, d] in q's dtype (causal).
        """
        if not self._allocated:
            self._allocate(q, k, attention_mask)
        if self._one_token:  # one-token decoding without gradients (see _allocate)
            self.reads += 1
            return self.decode_step(q, k, v, scale, start, stop)
        reader = self.reads
        self.reads += 1
        tracked = self.track_grad and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad or self.needs_grad(start, stop)
        )
        if not tracked:
            if self.fast and q.shape[2] == 1 and attention_mask is None:
                with torch.no_grad():
                    return self.decode_step(q, k, v, scale, start, stop)
            if self.fast:
                with torch.no_grad():
                    return self.fast_forward(q, k, v, attention_mask, scale, start, stop)[0]
            depth_k, depth_v = self.window(start, stop)
            return moda_attention_with_backend(q, k, v, depth_k, depth_v, attention_mask, scale, True, self.backend)
        if self.needs_grad(start, stop):
            for slot in range(start, stop):
                if reader not in self._readers_of[slot]:  # (a recomputed layer reads again)
                    self._readers_of[slot].append(reader)
        token = self._token if self.needs_grad(start, stop) else None
        return _StreamRead.apply(self, reader, start, stop, attention_mask, scale, token, q, k, v)

    # ---- the fast CPU path ------------------------------------------------------------------------------

    def _sequence_mask(self, attention_mask: torch.Tensor | None, q_len: int, kv_len: int, dtype: torch.dtype):
        """``_sequence_mask`` of ``moda_attention``, built once per pass for the layers' shared mask."""
        key = (id(attention_mask), q_len, kv_len)
        if key not in self._masks:
            self._masks[key] = (attention_mask, *_sequence_mask(attention_mask, True, q_len, kv_len, dtype))
        return self._masks[key][1:]

    def decode_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int,
                    stop: int) -> torch.Tensor:
        """One query token per sequence, no mask (cached greedy decoding): one concatenation, one SDPA call.

        The query sits at the last of the S positions, so causality hides nothing: the joint softmax over
        ``[S sequence keys | M depth entries]`` is plain attention over the concatenated keys and values,
        which SDPA computes in one fused call. A GQA group's G query heads become G query rows of their KV
        head (no K/V repeat). Fast path only: the entries are read as they were written.

        Args:
            q: [B, Hq, 1, d]; k, v: [B, Hkv, S, d]. Returns [B, Hq, 1, d].
        """
        batch, num_q_heads, _, head_dim = q.shape
        num_kv_heads = k.shape[1]
        if stop > start:
            k = torch.cat([k, *self._entry_lists[0][start:stop]], dim=2)  # (B, Hkv, S + M, d)
            v = torch.cat([v, *self._entry_lists[1][start:stop]], dim=2)
        q_rows = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # (B, Hkv, G, d)
        out = F.scaled_dot_product_attention(q_rows, k, v, scale=scale)  # (B, Hkv, G, d)
        return out.reshape(batch, num_q_heads, 1, head_dim)

    def _slot_window(self, start: int, stop: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Entries ``[start, stop)`` as rows ``keys``, ``values``: M tensors [N, d] each (N = B Hkv T tokens; views)."""
        if not 0 <= start <= stop <= self.written:
            raise RuntimeError(f"DepthStream: window [{start}, {stop}) outside the {self.written} written slots")
        for rows, entries in zip(self._entry_rows, self._entry_lists):  # made when first read
            rows.extend(_entry_rows(entry) for entry in entries[len(rows):stop])
        return self._entry_rows[0][start:stop], self._entry_rows[1][start:stop]

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A contiguous work buffer of ``like``'s shape and dtype, the same tensor for every layer of the pass: what
        it holds is used up before the next call (products summed at once, the kernel's gradient input)."""
        if self._scratch is None or self._scratch.shape != like.shape or self._scratch.dtype != like.dtype:
            self._scratch = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return self._scratch

    def fast_forward(self, q, k, v, attention_mask, scale: float, start: int, stop: int):
        """The attention on CPU (fp32 / fp64) without autograd: ``(out [B, Hq, T, d], saved)``.

        Exact merge of the sequence pool (SDPA's flash kernel: output ``o_s`` and log-sum-exp ``lse_s``)
        with the depth logits ``l``: with ``Z = exp(lse_s) + sum_m exp(l_m)``, ``out = exp(lse_s) / Z o_s +
        sum_m exp(l_m) / Z v_m`` (computed relative to the row maximum). The depth products read the
        entries in place (:func:`_depth_dots`, :func:`_depth_mix`). ``saved``: (q, k, v, out, lse, alpha [N, G],
        mask, is_causal, scale, probs [M, N, G]); without entries alpha is None and probs absent.
        """
        batch, num_q_heads, q_len, head_dim = q.shape
        num_kv_heads, kv_len = k.shape[1], k.shape[2]
        mask, is_causal, empty_rows = self._sequence_mask(attention_mask, q_len, kv_len, q.dtype)
        q, k, v = _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v)
        out_seq, lse_kernel = _FLASH_CPU(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        lse_seq = lse_kernel
        if empty_rows is not None:
            lse_seq = lse_seq.masked_fill(empty_rows, float("-inf"))
            out_seq = out_seq.masked_fill(empty_rows.unsqueeze(-1), 0.0)  # alpha is 0 there: keep 0 * out finite
        num_entries = stop - start
        if num_entries == 0:  # layer 0: plain causal attention
            saved = (q, k, v, out_seq, lse_kernel, None, mask, is_causal, scale)
            return out_seq, saved
        key_slots, value_slots = self._slot_window(start, stop)  # M entries [N, d] each, views
        q_rows = _to_rows(q, num_kv_heads)  # (N, G, d)
        # One softmax over [sequence pool | depth entries], entry-major [1 + M, N, G] so that every step is a pass
        # over contiguous [N, G] planes: row 0 the sequence pool's log-sum-exp (-inf when it has no visible key:
        # weight exactly 0; the row maximum is finite, M >= 1), rows 1.. the depth logits.
        joint = q_rows.new_empty(num_entries + 1, *q_rows.shape[:2])
        joint[0] = _to_rows(lse_seq.unsqueeze(-1), num_kv_heads).squeeze(-1)
        _depth_dots(q_rows, key_slots, joint[1:], self.scratch(q_rows)).mul_(scale)
        weights = torch.softmax(joint, dim=0)
        alpha, probs = weights[0], weights[1:]  # (N, G): the sequence pool's share; (M, N, G)
        out_rows = _depth_mix(probs, value_slots, _to_rows(out_seq, num_kv_heads).mul_(alpha.unsqueeze(-1)))
        out = _from_rows(out_rows, batch, num_kv_heads, q_len)  # (B, Hq, T, d)
        saved = (q, k, v, out, lse_kernel, alpha, mask, is_causal, scale, probs)
        return out, saved

    def fast_backward(self, saved, grad_out: torch.Tensor, needs: tuple[bool, bool, bool], reader: int | None,
                      start: int, stop: int) -> tuple[torch.Tensor | None, ...]:
        """``(dq, dk, dv)`` of :meth:`fast_forward`; with ``reader``, its q, P, dS and dO are kept for the writers."""
        q, k, v, out, lse_kernel, alpha, mask, is_causal, scale = saved[:9]
        batch, num_q_heads, q_len, head_dim = q.shape
        num_kv_heads = k.shape[1]
        if alpha is None:  # no depth entry
            grads = _FLASH_CPU_BACKWARD(grad_out.contiguous(), q, k, v, out, lse_kernel, 0.0, is_causal,
                                        attn_mask=mask, scale=scale)
            return tuple(g if need else None for g, need in zip(grads, needs))
        probs = saved[9]  # (M, N, G)
        grad_rows = _to_rows(grad_out, num_kv_heads)  # (N, G, d)
        grad_seq = torch.mul(grad_rows, alpha.unsqueeze(-1), out=self.scratch(grad_rows))  # used up by the kernel
        grad_seq = _from_rows(grad_seq, batch, num_kv_heads, q_len)
        grad_q, grad_k, grad_v = _FLASH_CPU_BACKWARD(grad_seq, q, k, v, out, lse_kernel, 0.0, is_causal,
                                                     attn_mask=mask, scale=scale)
        self._check_versions(start, stop)
        key_slots, value_slots = self._slot_window(start, stop)  # M entries [N, d] each, views
        products = torch.mul(grad_rows, _to_rows(out, num_kv_heads), out=self.scratch(grad_rows))
        delta = products.sum(dim=-1)  # D = rowsum(dO * out), (N, G)
        grad_probs = _depth_dots(grad_rows, value_slots, torch.empty_like(probs), self.scratch(grad_rows))  # (M, N, G)
        grad_logits = grad_probs.sub_(delta).mul_(probs).mul_(scale)  # dS = P (dP - D) scale
        if needs[0]:
            grad_q_rows = _depth_mix(grad_logits, key_slots, _to_rows(grad_q, num_kv_heads))  # (N, G, d)
            grad_q = _from_rows(grad_q_rows, batch, num_kv_heads, q_len)
        if reader is not None:
            self._reader_backward[reader] = (_to_rows(q, num_kv_heads), probs, start, grad_logits, grad_rows)
            self._queue_reset()
        grads = (grad_q, grad_k, grad_v)
        return tuple(g if need else None for g, need in zip(grads, needs))

    # ---- gradients of the entries -------------------------------------------------------------------------

    def entry_gradient(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The complete gradient of entry ``slot`` (key, value [B, Hkv, T, d]); every reader has run its backward."""
        batch, num_kv_heads, q_len, _, head_dim = self.shape
        if not self.fast:
            grad_keys, grad_values = self.gradient_buffers()
            return grad_keys[slot].transpose(1, 2), grad_values[slot].transpose(1, 2)
        # dK_m = sum_r dS_r[m] q_r and dV_m = sum_r P_r[m] dO_r over the readers r of slot m whose backward ran (a
        # reader whose output was unused contributes 0): one fused multiply-add per reader into [N, G, d], streaming
        # the reader's own q / dO once (no copies, no per-token matrix products), and one sum over G at the end.
        grad_key = grad_value = None
        for reader in self._readers_of[slot]:
            if reader not in self._reader_backward:
                continue
            q_rows, probs, start, grad_logits, grad_rows = self._reader_backward[reader]
            key_weight, value_weight = grad_logits[slot - start].unsqueeze(-1), probs[slot - start].unsqueeze(-1)
            if grad_key is None:
                grad_key, grad_value = q_rows * key_weight, grad_rows * value_weight  # (N, G, d)
            else:
                grad_key.addcmul_(q_rows, key_weight)
                grad_value.addcmul_(grad_rows, value_weight)
            if slot == start:  # the writers run last slot first: no other slot of this reader is left
                del self._reader_backward[reader]
        if grad_key is None:  # nobody read it (or no reader's backward ran)
            zeros = torch.zeros(batch, num_kv_heads, q_len, head_dim, dtype=self.dtype, device=self.device)
            return zeros, zeros
        if grad_key.shape[1] == 1:  # (N, d)
            grad_key, grad_value = grad_key.squeeze(1), grad_value.squeeze(1)
        else:
            grad_key, grad_value = grad_key.sum(dim=1), grad_value.sum(dim=1)
        shape = (batch, q_len, num_kv_heads, head_dim)  # the slots' token order, handed on as [B, Hkv, T, d]
        return grad_key.view(shape).transpose(1, 2), grad_value.view(shape).transpose(1, 2)

    def gradient_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Generic path: the gradient buffers [M_max, B, T, Hkv, d], slot-major like the entries (zeroed at the
        first use in a backward pass)."""
        if self._grads is None:
            dtype = _accumulation_dtype(self.keys.dtype)
            self._grads = (torch.zeros(self.keys.shape, dtype=dtype, device=self.keys.device),  # slot-major
                           torch.zeros(self.values.shape, dtype=dtype, device=self.values.device))
            self._queue_reset()
        return self._grads

    def _queue_reset(self) -> None:
        if not self._reset_queued:
            self._reset_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Drop the backward's buffers (a second backward through a retained graph starts from zeros)."""
        self._grads = None
        self._reader_backward.clear()
        self._reset_queued = False


__all__ = ["DepthStream"]
