"""Mixture-of-Depths Attention (MoDA), the op of the MoDA family (arXiv 2603.15619).

A query token attends, in ONE softmax with one scale, to the causal sequence keys/values of its layer and to
its own ``M`` depth keys/values (entries written for the same token by earlier layers)::

    out[b, h, t] = softmax([q K_seq^T | q K_depth(t)^T] * scale) [V_seq ; V_depth(t)]

One entry point, :func:`moda_attention` (its docstring holds the dispatch table), and three implementations:
:func:`moda_reference` (the paper's loop), the PyTorch path (:func:`torch_moda_forward` / :func:`torch_moda_backward`,
in :class:`_MoDAFunction`) and the Triton kernels of ``moda_triton.py`` (the same Function). Self-contained (only
``torch`` and same-folder relative imports): ``save_pretrained`` copies it next to the model code.
"""

import contextlib
import functools
import math
from collections.abc import Sequence

import torch

from .depthfusion_common import BACKEND_ENV_VAR, BACKENDS  # noqa: F401 - part of the op's API
from .depthfusion_common import resolve_backend as resolve_op_backend
from .moda_torch import (
    _depth_dots,
    _entry_rows,
    _finite_or_inf,
    _from_rows,
    _masked_logits,
    _rows,
    _stack,
    _work_dtype,
    renormaliser,
    torch_moda_backward,
    torch_moda_forward,
    unresolved_rows,
)

try:  # Triton is optional: the model loads and runs without it.
    from .moda_triton import triton_moda_backward, triton_moda_forward
except Exception:  # pragma: no cover - depends on the environment
    triton_moda_forward = triton_moda_backward = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # floating inputs every path computes


def resolve_backend(backend: str | None, device: torch.device, config_backend: str | None = None) -> str:
    """The MoDA attention backend: ``"reference"``, ``"torch"`` or ``"triton"``, chosen by the one rule of
    :func:`depthfusion_common.resolve_backend` (the ``backend`` argument, ``$DEPTHFUSION_BACKEND``, the config's
    ``op_backend``, automatic); a ValueError for an unknown name or a Triton backend that cannot run."""
    return resolve_op_backend(backend, device, config_backend, kernels_imported=triton_moda_forward is not None,
                              op=__name__)


def _masked_softmax(logits: torch.Tensor, factors: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim whose scores ``exp(logit)`` are multiplied by ``factors`` (>= 0, broadcastable;
    None = 1); zeros (not NaN) for a row with no visible score. The shift is detached: a factor of 0 gets its
    gradient ``exp(logit) / sum`` (never through ``log(factor)``), except in a row with nothing else visible or whose
    shift is mask-sized (:func:`unresolved_rows`: every other score carries ``finfo.min``), where that score and its
    gradient are 0 (the row's output jumps as the factor leaves 0, or the score overflows)."""
    shifted = logits if factors is None else logits + factors.detach().log()
    row_max = shifted.amax(dim=-1, keepdim=True).detach()
    weights = torch.exp(logits - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)))
    if factors is not None:  # (a closed score's logit is replaced before exp: no inf, no NaN in the gradient)
        closed = (factors == 0) & ~(torch.isfinite(row_max) & ~unresolved_rows(row_max))
        weights = torch.exp(torch.where(closed, row_max, logits) - torch.where(torch.isfinite(row_max), row_max, 0))
        weights = torch.where(closed, torch.zeros_like(weights), weights) * factors
    total = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


def moda_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, depth_k: torch.Tensor, depth_v: torch.Tensor,
                   attention_mask: torch.Tensor | None, scale: float, causal: bool,
                   depth_gate: torch.Tensor | None = None) -> torch.Tensor:
    """The definition, one (batch, head, token) at a time, in float32 (float64 stays float64).

    q: [B, Hq, T, d]; k, v: [B, Hkv, S, d]; depth_k, depth_v: [B, Hkv, T, M, d]; the mask bool (True = attend) or
    additive float, broadcastable to [B, Hq, T, S]; ``depth_gate`` [Hq] (>= 0) or None: head h's depth scores
    ``exp(logit)`` are multiplied by ``depth_gate[h]``. Returns [B, Hq, T, d] in q's dtype (zeros for a row that
    sees no entry, and for B = 0 or T = 0)."""
    (batch, num_q_heads, q_len), kv_len = q.shape[:3], k.shape[2]
    group, work = num_q_heads // k.shape[1], _work_dtype(q.dtype)
    mask = None if attention_mask is None else attention_mask.expand(batch, num_q_heads, q_len, kv_len)
    out = torch.zeros(q.shape, dtype=work, device=q.device)
    for b in range(batch):
        for h in range(num_q_heads):
            for t in range(q_len):
                visible = kv_len - q_len + t + 1 if causal else kv_len
                query = q[b, h, t].to(work)
                logits = (k[b, h // group, :visible].to(work) @ query) * scale  # (visible,)
                if mask is not None and mask.dtype == torch.bool:
                    logits = logits.masked_fill(~mask[b, h, t, :visible], float("-inf"))
                elif mask is not None:
                    row = mask[b, h, t, :visible].to(work)
                    logits = (logits + row).masked_fill(row == float("-inf"), float("-inf"))
                logits = torch.cat([logits, (depth_k[b, h // group, t].to(work) @ query) * scale])
                factors = None if depth_gate is None else torch.cat(
                    [logits.new_ones(visible), depth_gate[h].to(work).expand(logits.shape[0] - visible)])
                weights = _masked_softmax(logits, factors)
                out[b, h, t] = weights[:visible] @ v[b, h // group, :visible].to(work) + (
                    weights[visible:] @ depth_v[b, h // group, t].to(work))
    return out.to(q.dtype)


def _kernel_forward(q, k, v, keys, values, attention_mask, scale, causal, backend, gate):
    """``(out, lse, lse_seq, renorm)`` of the ``"torch"`` or ``"triton"`` forward, no autograd. The Triton path stacks
    the entries transiently; its ``lse_seq`` is the kernels' joint lse in their log2 domain, which their backward
    reads as it is (a mask-sized lse does not survive a round trip through the natural log)."""
    if backend == "triton":
        out, lse2, renorm = triton_moda_forward(q, k, v, *(_stack(x, q, k.shape[1]) for x in (keys, values)),
                                                attention_mask, scale, causal, gate)
        return out, lse2 * math.log(2.0), lse2, renorm
    return torch_moda_forward(q, k, v, keys, values, attention_mask, scale, causal, gate)


class _MoDAFunction(torch.autograd.Function):
    """MoDA on the ``"torch"`` or ``"triton"`` path with autograd: ``apply(q, k, v, attention_mask, depth_gate, scale,
    causal, backend, num_keys, *entries)``, ``entries`` = the window's keys then values, each [B, Hkv, T, d]. Saves
    q, k, v, the mask, the gate, the output, the log-sum-exp(s), the renormaliser (rows whose log-sum-exp the dtype
    cannot hold: the incoming gradient is scaled by it, which is exact, as every gradient is linear in it) and
    references to the entries."""

    @staticmethod
    def forward(ctx, q, k, v, attention_mask, gate, scale, causal, backend, num_keys, *entries):  # noqa: D102
        keys, values = entries[:num_keys], entries[num_keys:]
        out, lse, lse_seq, renorm = _kernel_forward(q, k, v, keys, values, attention_mask, scale, causal, backend,
                                                    gate)
        ctx.save_for_backward(q, k, v, attention_mask, gate, out, lse, lse_seq, renorm, *entries)
        ctx.scale, ctx.causal, ctx.backend, ctx.num_keys = scale, causal, backend, num_keys
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, attention_mask, gate, out, lse, lse_seq, renorm, *entries = ctx.saved_tensors
        keys, values = entries[:ctx.num_keys], entries[ctx.num_keys:]
        if renorm is not None:
            grad_out = (grad_out.to(renorm.dtype) * renorm.unsqueeze(-1)).to(grad_out.dtype)
        if ctx.backend == "triton" and not torch.is_grad_enabled() and not ctx.needs_input_grad[3]:
            stacked = [_stack(x, q, k.shape[1]) for x in (keys, values)]
            grad_q, grad_k, grad_v, _, grad_depth_k, grad_depth_v, grad_gate = triton_moda_backward(
                grad_out, q, k, v, *stacked, attention_mask, out, lse_seq, ctx.scale, ctx.causal, gate)
            grad_keys = [g.transpose(1, 2) for g in grad_depth_k.unbind(3)]
            grad_values = [g.transpose(1, 2) for g in grad_depth_v.unbind(3)]
            grad_mask = None
        else:
            grad_q, grad_k, grad_v, grad_mask, grad_keys, grad_values, grad_gate = torch_moda_backward(
                grad_out, q, k, v, keys, values, attention_mask, out, lse, lse_seq, ctx.scale, ctx.causal, gate)
        return grad_q, grad_k, grad_v, grad_mask, grad_gate, None, None, None, None, *grad_keys, *grad_values


def moda_attention_weights(q, k, keys, attention_mask, scale, causal, depth_gate=None):
    """The joint softmax weights [B, Hq, T, S + M] (sequence columns first; fp32, fp64 for fp64 inputs; zeros for a
    row with no visible entry) with autograd, for q [B, Hq, T, d], k [B, Hkv, S, d], M keys [B, Hkv, T, d] and the
    depth gate [Hq] (>= 0: multiplies head h's depth scores) or None."""
    batch, num_q_heads, q_len, _ = q.shape
    seq = _masked_logits(q, k, attention_mask, scale, causal).flatten(1, 2)  # (B, Hq, T, S)
    depth = _depth_dots(_rows(q, k.shape[1]).to(seq.dtype), [_entry_rows(e, seq.dtype) for e in keys]) * scale
    logits = torch.cat([seq, _from_rows(depth, batch, q_len)], dim=-1)
    if depth_gate is not None:
        factors = torch.cat([seq.new_ones(seq.shape[-1]).expand(num_q_heads, -1),
                             depth_gate.to(seq.dtype)[:, None].expand(-1, len(keys))], dim=-1)
        return _masked_softmax(logits, factors[:, None])
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - _finite_or_inf(lse).unsqueeze(-1))
    if attention_mask is not None and attention_mask.is_floating_point():
        weights = weights * renormaliser(lse, weights.sum(dim=-1)).unsqueeze(-1)
    return weights


def _weights_times_values(weights, v, values):
    """[B, Hq, T, d] = weights [B, Hq, T, S + M] (sequence columns first) times [V_seq ; the token's M values]."""
    kv_len, num_kv_heads, work = v.shape[2], v.shape[1], weights.dtype
    out = torch.matmul(weights[..., :kv_len].unflatten(1, (num_kv_heads, -1)), v.to(work).unsqueeze(2)).flatten(1, 2)
    if not values:
        return out
    depth_values = torch.cat([_entry_rows(e, work) for e in values], dim=-1).transpose(1, 2)  # (N, M, d)
    depth = torch.bmm(_rows(weights[..., kv_len:], num_kv_heads), depth_values)  # (N, G, d)
    return out + _from_rows(depth, weights.shape[0], weights.shape[2])


def _check_gate(gate, num_q_heads: int, device: torch.device) -> None:
    """Raise a ValueError unless ``gate`` is a float tensor [Hq] on q's device with values >= 0 (checked on CPU;
    on other devices by an asynchronous assertion: no host synchronisation)."""
    if not torch.is_tensor(gate) or gate.shape != (num_q_heads,) or gate.dtype not in DTYPES or gate.device != device:
        found = (tuple(gate.shape), gate.dtype, gate.device) if torch.is_tensor(gate) else type(gate).__name__
        raise ValueError(f"depth_gate must be None or a float tensor [Hq={num_q_heads}] on q's device {device}; "
                         f"got {found}")
    valid = ((gate >= 0) & torch.isfinite(gate)).all()
    if gate.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(valid, "depth_gate must be finite and >= 0")
    elif not bool(valid):
        raise ValueError(f"depth_gate must be finite and >= 0 (a factor of the depth scores); got {gate.tolist()}")


def _check_inputs(q, k, v, keys, values, attention_mask, scale) -> None:
    """Raise a ValueError naming the argument and what it must be (no host synchronisation)."""
    if q.dim() != 4 or q.shape[-1] < 1:
        raise ValueError(f"q must have shape [B, Hq, T, d] with a head dim d >= 1; got {tuple(q.shape)}")
    (batch, num_q_heads, q_len, head_dim), shape = q.shape, lambda x: tuple(x.shape)
    if k.dim() != 4 or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k must have shape [B={batch}, Hkv, S, d={head_dim}]; got {shape(k)}")
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0 or kv_len < q_len:
        raise ValueError(f"k must have Hkv heads, Hq={num_q_heads} a multiple of Hkv, and S >= T={q_len} positions "
                         f"(queries are the last T of S); got {shape(k)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k, {shape(k)}; got {shape(v)}")
    device, entry = q.device, (batch, num_kv_heads, q_len, head_dim)
    for name, tensors in (("q", (q,)), ("k", (k,)), ("v", (v,)), ("depth_k", keys), ("depth_v", values)):
        for x in tensors:  # attribute reads only: this runs for every layer of every decoding step
            if x.dtype not in DTYPES or x.device != device:
                raise ValueError(f"{name} must have a floating dtype in {DTYPES} on q's device {device}; "
                                 f"got {x.dtype} on {x.device}")
            if name.startswith("depth") and x.shape != entry:
                raise ValueError(f"{name} must have entries of shape [B, Hkv, T, d] = {entry} (as a tensor "
                                 f"[B, Hkv, T, M, d] or a sequence of M entries); got an entry of {shape(x)}")
    if len(keys) != len(values):
        raise ValueError(f"depth_v must have as many entries as depth_k ({len(keys)}); got {len(values)}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite real number (0 and negative scales are computed); got {scale!r}")
    if attention_mask is None:
        return
    target = (batch, num_q_heads, q_len, kv_len)
    try:
        fits = attention_mask.dim() <= 4 and torch.broadcast_shapes(attention_mask.shape, target) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"attention_mask must be broadcastable to [B, Hq, T, S] = {target}; "
                         f"got {shape(attention_mask)}")
    if attention_mask.dtype != torch.bool and attention_mask.dtype not in DTYPES or attention_mask.device != q.device:
        raise ValueError(f"attention_mask must be bool (True = attend) or additive float {DTYPES} on q's device "
                         f"{q.device}; got {attention_mask.dtype} on {attention_mask.device}")


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    on = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    return torch.get_autocast_dtype(device_type) if on else None  # the autocast dtype where autocast is on


def moda_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, depth_k: torch.Tensor | Sequence[torch.Tensor],
                   depth_v: torch.Tensor | Sequence[torch.Tensor], *, attention_mask: torch.Tensor | None = None,
                   scale: float | None = None, causal: bool = True, backend: str | None = None,
                   return_weights: bool = False, depth_gate: torch.Tensor | None = None,
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mixture-of-depths attention: one softmax over the causal sequence keys and the token's own depth keys.

    =============  ===========================================================================================
    backend        implementation
    =============  ===========================================================================================
    reference      :func:`moda_reference`: one (batch, head, token) at a time; plain autograd. The oracle.
    torch          :func:`torch_moda_forward` (in :class:`_MoDAFunction` when a gradient is needed), the entries
                   read in place (never stacked or copied); saved are q, k, v, the mask, the output, the row
                   log-sum-exp and references to the entries. Forward: the sequence pool through SDPA's fused CPU
                   kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, a private op: no public API
                   returns the row log-sum-exp the merge needs) on CPU with no mask but causality and a positive
                   scale, else materialised; the depth pool as one product per entry, merged exactly. Backward:
                   the probabilities recomputed from the log-sum-exp (flash style) in differentiable torch ops,
                   so ``create_graph=True`` works (the fused kernel's backward on its path, first order). A
                   one-token step without mask or gradient: one SDPA over [sequence | its entries].
    triton         the same, around the kernels of ``moda_triton.py`` (CUDA, or CPU under ``TRITON_INTERPRET=1``),
                   the window stacked transiently in each pass; a backward with ``create_graph=True`` runs the
                   torch backward on the kernel's output and log-sum-exp.
    =============  ===========================================================================================

    Decided here, once per call: validation (no host synchronisation); ONE compute dtype for every backend: under
    autocast for q's device type the autocast dtype (as SDPA; float64, which autocast leaves alone, stays), else
    the promoted dtype of q, k, v and the entries, every input cast to it; the backend (argument >
    ``$DEPTHFUSION_BACKEND`` > automatic: Triton for CUDA tensors when it imports; a model passes its
    ``config.op_backend`` through :func:`resolve_backend`); from ``triton`` to ``torch``: float64 and a float mask
    that needs a gradient (fp32 stays: TF32 dots where ``torch.get_float32_matmul_precision()`` allows, else IEEE
    with small tiles); no queries (B = 0 or T = 0): zeros; ``return_weights``: the output is the weights times the
    values (as Llama's eager attention), so the weights are in its graph. A key hidden by causality or the mask
    (False, ``-inf``) contributes exactly nothing to the output on every backend, NaN or inf included.

    Args:
        q: [B, Hq, T, d] queries, at the last T of the S sequence positions (prefill S = T; decoding S = past + T).
        k, v: [B, Hkv, S, d] sequence keys/values; query head ``h`` uses KV head ``h // (Hq / Hkv)``.
        depth_k, depth_v: each token's M depth entries (M may be 0), same GQA mapping: a tensor [B, Hkv, T, M, d]
            or a sequence of M tensors [B, Hkv, T, d] (what a model passes: the entries as its layers wrote them).
        attention_mask: None, bool (True = attend) or additive float, broadcastable to [B, Hq, T, S]; sequence
            pool only (depth entries are always visible to their token). A float mask that requires grad gets it.
        scale: logit scale of both pools, any finite number (default ``1 / sqrt(d)``).
        causal: hide sequence keys after the query's position ``S - T + t``.
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` or None.
        return_weights: also return the joint softmax weights [B, Hq, T, S + M] (fp32, sequence columns first),
            with autograd.
        depth_gate: None, or [Hq] factors >= 0 of each head's depth scores: ``o = (Z_s o_s + g Z_d o_d) / (Z_s +
            g Z_d)`` (the depth logits get ``+ log g``; 0 = the sequence attention exactly). Differentiable at 0.
    Returns [B, Hq, T, d] in the compute dtype, differentiable twice (or ``(out, weights)``); a row with no
    visible entry is zeros. Raises ValueError for a shape, dtype, device or scale that does not fit (naming the
    argument and what it must be), and for an unknown backend or one that cannot run here.
    """
    # the depth as M entries [B, Hkv, T, d] (a [B, Hkv, T, M, d] tensor as views; a wrong rank fails the entry check)
    keys, values = (x.unbind(3) if torch.is_tensor(x) and x.dim() == 5 else tuple(x) for x in (depth_k, depth_v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None and q.dim() == 4 and q.shape[-1] > 0 else scale
    _check_inputs(q, k, v, keys, values, attention_mask, scale)
    if depth_gate is not None:
        _check_gate(depth_gate, q.shape[1], q.device)
    dtypes = {x.dtype for x in (q, k, v, *keys, *values)}
    autocast = _autocast_dtype(q.device.type) if torch.float64 not in dtypes else None
    dtype = autocast if autocast is not None else functools.reduce(torch.promote_types, dtypes)
    if dtypes != {dtype}:  # (no pass over the inputs when they all have it)
        q, k, v, *entries = (x if x.dtype == dtype else x.to(dtype) for x in (q, k, v, *keys, *values))
        keys, values = tuple(entries[:len(keys)]), tuple(entries[len(keys):])
    scale, causal = float(scale), bool(causal)
    backend = resolve_backend(backend, q.device)
    grad = torch.is_grad_enabled()
    needs_grad = grad and any(x.requires_grad for x in (q, k, v, *keys, *values, attention_mask, depth_gate)
                              if x is not None)
    if backend == "triton" and (dtype == torch.float64  # the kernels accumulate in fp32; no mask gradient
                                or grad and attention_mask is not None and attention_mask.requires_grad):
        backend = "torch"
    with torch.autocast(q.device.type, enabled=False) if autocast is not None else contextlib.nullcontext():
        weights = None
        if q.shape[0] * q.shape[2] == 0:  # no queries: zeros, connected to every input (zero gradients)
            out = q.new_zeros(q.shape) + sum(x[:0].sum() for x in (q, k, v, *keys, *values, depth_gate)
                                             if x is not None)
        elif return_weights:  # the output from the weights (as Llama's eager attention): they are in its graph
            weights = moda_attention_weights(q, k, keys, attention_mask, scale, causal, depth_gate)
            out = _weights_times_values(weights, v, values).to(dtype)
        elif backend == "torch" and q.shape[2] == 1 and attention_mask is None and not needs_grad:
            # A decoding step: the one query token's joint softmax is one SDPA over [sequence | its depth entries]
            # (the gate as an additive log g on the depth columns).
            gate_mask = None if depth_gate is None else torch.cat(
                [q.new_zeros(q.shape[1], 1, k.shape[2]), depth_gate.log().to(dtype)[:, None, None].expand(-1, 1,
                                                                                                   len(keys))], -1)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, torch.cat([k, *keys], dim=2), torch.cat([v, *values], dim=2), attn_mask=gate_mask, scale=scale,
                enable_gqa=q.shape[1] != k.shape[1])
        elif backend == "reference":
            stacked = [torch.stack(x, dim=3) if x else q.new_zeros(*k.shape[:2], q.shape[2], 0, q.shape[3])
                       for x in (keys, values)]
            out = moda_reference(q, k, v, *stacked, attention_mask, scale, causal, depth_gate)
        elif not needs_grad:  # the forward alone (torch.compile 2.13 mis-binds two entries of a Function in no_grad)
            out = _kernel_forward(q, k, v, keys, values, attention_mask, scale, causal, backend, depth_gate)[0]
        else:
            out = _MoDAFunction.apply(q, k, v, attention_mask, depth_gate, scale, causal, backend, len(keys), *keys,
                                      *values)
        for depth in (depth_k, depth_v):
            if isinstance(depth, torch.Tensor) and not keys:  # an empty [B, Hkv, T, 0, d]: keep it in the graph
                out = out + depth.sum().to(out.dtype)  # (an exact 0)
        if not return_weights:
            return out
    return out, weights if weights is not None else moda_attention_weights(q, k, keys, attention_mask, scale, causal,
                                                                           depth_gate)


__all__ = ["moda_attention", "moda_attention_weights", "moda_reference", "resolve_backend"]
