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

try:  # Triton is optional: the model loads and runs without it.
    from .moda_triton import triton_moda_backward, triton_moda_forward
except Exception:  # pragma: no cover - depends on the environment
    triton_moda_forward = triton_moda_backward = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # floating inputs every path computes
# SDPA's fused CPU kernel; it also returns the row log-sum-exp, which no public API gives.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def resolve_backend(backend: str | None, device: torch.device, config_backend: str | None = None) -> str:
    """The MoDA attention backend: ``"reference"``, ``"torch"`` or ``"triton"``, chosen by the one rule of
    :func:`depthfusion_common.resolve_backend` (the ``backend`` argument, ``$DEPTHFUSION_BACKEND``, the config's
    ``op_backend``, automatic); a ValueError for an unknown name or a Triton backend that cannot run."""
    return resolve_op_backend(backend, device, config_backend, kernels_imported=triton_moda_forward is not None,
                              op=__name__)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:  # float64 for float64, else float32 (exact for every input)
    return torch.float64 if dtype == torch.float64 else torch.float32


def _masked_softmax(logits: torch.Tensor) -> torch.Tensor:  # softmax, zeros (not NaN) for a row of only -inf
    row_max = logits.amax(dim=-1, keepdim=True).detach()
    weights = torch.exp(logits - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)))
    total = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


def moda_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, depth_k: torch.Tensor, depth_v: torch.Tensor,
                   attention_mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    """The definition, one (batch, head, token) at a time, in float32 (float64 stays float64).

    q: [B, Hq, T, d]; k, v: [B, Hkv, S, d]; depth_k, depth_v: [B, Hkv, T, M, d]; the mask bool (True = attend) or
    additive float, broadcastable to [B, Hq, T, S]. Returns [B, Hq, T, d] in q's dtype (zeros for a row that sees
    no entry, and for B = 0 or T = 0)."""
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
                weights = _masked_softmax(logits)
                out[b, h, t] = weights[:visible] @ v[b, h // group, :visible].to(work) + (
                    weights[visible:] @ depth_v[b, h // group, t].to(work))
    return out.to(q.dtype)


def _rows(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, T, *rest] -> [N, G, *rest], N = B * T * Hkv tokens in (batch, position, KV head) order; a view for
    tensors laid out [B, T, Hq, ...] (the projections' queries, the fused kernel's output)."""
    batch, num_q_heads, q_len = x.shape[:3]
    return x.transpose(1, 2).reshape(batch * q_len * num_kv_heads, num_q_heads // num_kv_heads, *x.shape[3:])


def _from_rows(x: torch.Tensor, batch: int, q_len: int) -> torch.Tensor:
    """[N, G, *rest] -> [B, Hq, T, *rest] (inverse of :func:`_rows`), a view laid out [B, T, Hq, ...]."""
    return x.reshape(batch, q_len, x.shape[0] // (batch * q_len) * x.shape[1], *x.shape[2:]).transpose(1, 2)


def _stack(entries: Sequence[torch.Tensor], q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """M entries [B, Hkv, T, d] -> one token-major tensor [B, T, Hkv, M, d] (a fresh copy; M = 0: empty)."""
    empty = q.new_empty(q.shape[0], q.shape[2], num_kv_heads, 0, q.shape[3])
    return torch.stack([e.transpose(1, 2) for e in entries], dim=3) if entries else empty


def _masked_logits(q, k, attention_mask, scale, causal):
    """Scaled sequence logits [B, Hkv, G, T, S] in the work dtype, hidden keys at ``-inf`` (their logit is
    replaced, not added to, so a NaN key behind the mask is gone). Differentiable (in-place ops are safe)."""
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    work = _work_dtype(q.dtype)
    queries = q.reshape(batch, num_kv_heads, -1, head_dim).to(work)  # query head h = kv * G + g
    logits = torch.matmul(queries, k.to(work).transpose(-1, -2)).mul_(scale)
    logits = logits.view(batch, num_kv_heads, -1, q_len, kv_len)
    if causal and q_len > 1:
        keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril_(kv_len - q_len)  # j <= S - T + t
        logits.masked_fill_(~keep, float("-inf"))
    if attention_mask is not None:
        mask = attention_mask
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.unflatten(1, (num_kv_heads, -1))
        if mask.dtype == torch.bool:
            logits.masked_fill_(~mask, float("-inf"))
        else:
            logits.add_(mask.to(work)).masked_fill_(mask == float("-inf"), float("-inf"))
    return logits


def _flash_applies(q, k, attention_mask, scale, causal) -> bool:
    """SDPA's fused CPU kernel serves the sequence pool: CPU, no mask but causality, aligned (T = S or T = 1), and a
    positive scale (the kernel masks before it scales: a zero or negative scale turns hidden keys into NaN/+inf)."""
    return (_FLASH_CPU is not None and q.device.type == "cpu" and attention_mask is None and scale > 0
            and (not causal or q.shape[2] in (1, k.shape[2])))


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()  # the fused CPU kernel assumes a unit-stride last dim


def _sequence_pool(q, k, v, attention_mask, scale, causal):
    """The sequence pool alone, no autograd: ``(out [B, Hq, T, d], lse [B, Hq, T])``; a row without a visible key
    has out 0 and lse ``-inf``. The fused CPU kernel where it applies (its causal masking never reads a hidden
    key), else materialised in the work dtype."""
    batch, num_q_heads, q_len, head_dim = q.shape
    if _flash_applies(q, k, attention_mask, scale, causal):
        return _FLASH_CPU(_unit_stride(q), _unit_stride(k), _unit_stride(v), 0.0, causal and q_len > 1, scale=scale)
    logits = _masked_logits(q, k, attention_mask, scale, causal).flatten(2, 3)  # (B, Hkv, G*T, S)
    lse = torch.logsumexp(logits, dim=-1)
    probs = logits.sub_(_finite_or_inf(lse).unsqueeze(-1)).exp_()
    out = torch.matmul(probs, v.to(probs.dtype))  # (B, Hkv, G*T, d)
    return out.view(batch, num_q_heads, q_len, head_dim), lse.view(batch, num_q_heads, q_len)


def _entry_rows(entry: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An entry [B, Hkv, T, d] as rows [N, d, 1] (bmm operands) in :func:`_rows`' order (a view if [B, T, Hkv, d])."""
    return entry.transpose(1, 2).reshape(-1, entry.shape[-1], 1).to(dtype)


def _depth_dots(rows: torch.Tensor, entries: Sequence[torch.Tensor]) -> torch.Tensor:
    """[N, G, M]: each row [N, G, d] dotted with its token's M entries (rows [N, d, 1] each): one ``bmm`` per entry
    (no [N, G, d] temporary: fresh memory costs page faults on CPU; the entries are separate tensors)."""
    products = [torch.bmm(rows, entry) for entry in entries]
    return torch.cat(products, dim=-1) if products else rows.new_zeros(*rows.shape[:2], 0)


def _finite_or_inf(lse: torch.Tensor) -> torch.Tensor:
    """``-inf`` (a row that sees no entry) -> ``+inf``, so that every ``exp(logit - lse)`` of the row is 0."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def torch_moda_forward(q, k, v, keys, values, attention_mask, scale, causal):
    """The PyTorch forward, no autograd: ``(out [B, Hq, T, d] in q's dtype, lse, lse_seq)`` for q [B, Hq, T, d], k, v
    [B, Hkv, S, d] and the M entries ``keys``, ``values`` [B, Hkv, T, d] each (read in place), all one dtype.

    The sequence pool (out_s, lse_s) merged with the depth logits ``l_m``: ``lse = logaddexp(lse_s, logsumexp_m
    l_m)`` [B, Hq, T] (work dtype; ``+inf`` for a row that sees no entry), ``out = exp(lse_s - lse) out_s +
    sum_m exp(l_m - lse) v_m``; ``lse_seq`` is lse_s as the pool computed it.
    """
    batch, num_q_heads, q_len, _ = q.shape
    num_kv_heads, work = k.shape[1], _work_dtype(q.dtype)
    out_seq, lse_seq = _sequence_pool(q, k, v, attention_mask, scale, causal)
    if not keys:
        return out_seq.to(q.dtype), _finite_or_inf(lse_seq.to(work)), lse_seq
    q_rows, lse_rows = _rows(q, num_kv_heads).to(work), _rows(lse_seq, num_kv_heads).to(work)  # (N, G, d), (N, G)
    logits = _depth_dots(q_rows, [_entry_rows(e, work) for e in keys]).mul_(scale)  # (N, G, M)
    lse = _finite_or_inf(torch.logaddexp(lse_rows, torch.logsumexp(logits, dim=-1)))
    out = _rows(out_seq, num_kv_heads).to(work).mul_((lse_rows - lse).exp_().unsqueeze(-1))  # out_seq is ours
    probs = logits.sub_(lse.unsqueeze(-1)).exp_()
    for m, value in enumerate(values):
        out.addcmul_(_entry_rows(value, work).transpose(1, 2), probs[..., m, None])
    return _from_rows(out, batch, q_len).to(q.dtype), _from_rows(lse, batch, q_len), lse_seq


def torch_moda_backward(grad_out, q, k, v, keys, values, attention_mask, out, lse, lse_seq, scale, causal):
    """The backward of :func:`torch_moda_forward` in differentiable torch ops (``create_graph=True`` works).

    Every joint logit gets ``dS = P (dP - D)``, ``P = exp(logit - lse)``, ``dP = dO . v``, ``D = rowsum(dO out)``.
    Under ``create_graph`` lse is recomputed from the logits (its own dependence on the inputs is differentiated);
    else on the fused kernel's path the sequence pool's gradients are its backward's for ``alpha dO``, ``alpha =
    exp(lse_seq - lse)``: it forms ``alpha P_s (dP - D) = dS``. Returns ``(dq, dk, dv, d_mask or None, d_keys,
    d_values)``, the entries' gradients as lists of separate [B, Hkv, T, d] tensors, each in its input's dtype.
    """
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, work, second_order = k.shape[1], _work_dtype(q.dtype), torch.is_grad_enabled()
    grad = grad_out.to(work)
    q_rows, grad_rows = _rows(q, num_kv_heads).to(work), _rows(grad, num_kv_heads)  # (N, G, d)
    key_rows, value_rows = [_entry_rows(e, work) for e in keys], [_entry_rows(e, work) for e in values]
    depth_logits = _depth_dots(q_rows, key_rows) * scale  # (N, G, M)
    flash = _flash_applies(q, k, attention_mask, scale, causal) and not second_order
    delta = None if flash and not keys else torch.linalg.vecdot(grad, out.to(work))  # D = rowsum(dO out), (B, Hq, T)
    grad_mask = None
    if flash:
        grad_seq = (grad * (lse_seq.to(work) - lse).exp_().unsqueeze(-1)).to(q.dtype) if keys else grad_out
        grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_seq, _unit_stride(q), _unit_stride(k), _unit_stride(v), out, lse_seq, 0.0, causal and q_len > 1,
            scale=scale)
    else:
        logits = _masked_logits(q, k, attention_mask, scale, causal)  # (B, Hkv, G, T, S)
        if second_order:
            lse_rows = _rows(torch.logsumexp(logits, -1).flatten(1, 2), num_kv_heads)
            lse = _from_rows(_finite_or_inf(torch.logaddexp(lse_rows, torch.logsumexp(depth_logits, dim=-1))),
                             batch, q_len)
        probs = torch.exp(logits - lse.reshape(batch, num_kv_heads, -1, q_len, 1)).flatten(2, 3)
        grad_heads = grad.reshape(batch, num_kv_heads, -1, head_dim)  # (B, Hkv, G*T, d): query head h = kv*G + g
        grad_logits = torch.matmul(grad_heads, v.to(work).transpose(-1, -2))
        grad_logits = probs * grad_logits.sub_(delta.reshape(batch, num_kv_heads, -1, 1))
        grad_q = torch.matmul(grad_logits, k.to(work)).mul_(scale).view(q.shape)
        grad_k = torch.matmul(grad_logits.transpose(-1, -2), q.reshape(grad_heads.shape).to(work)).mul_(scale)
        grad_v = torch.matmul(probs.transpose(-1, -2), grad_heads)
        if attention_mask is not None and attention_mask.is_floating_point() and attention_mask.requires_grad:
            grad_mask = grad_logits.view(batch, num_q_heads, q_len, -1).sum_to_size(attention_mask.shape)
            grad_mask = grad_mask.to(attention_mask.dtype)
    grad_keys, grad_values = [], []
    if keys:
        depth_probs = torch.exp(depth_logits - _rows(lse, num_kv_heads).unsqueeze(-1))  # (N, G, M)
        depth_grad_logits = _depth_dots(grad_rows, value_rows) - _rows(delta, num_kv_heads).unsqueeze(-1)
        depth_grad_logits = depth_probs * depth_grad_logits * scale  # scaled dS: the logits were scaled
        grad_q_rows = _rows(grad_q.to(work), num_kv_heads)
        for m, key in enumerate(key_rows):
            grad_q_rows = grad_q_rows.addcmul_(key.transpose(1, 2), depth_grad_logits[..., m, None])
        grad_q = _from_rows(grad_q_rows, batch, q_len)
        for weights, rows, grads, entries in ((depth_grad_logits, q_rows, grad_keys, keys),
                                              (depth_probs, grad_rows, grad_values, values)):
            for m, entry in enumerate(entries):  # sum over the G query heads of the entry's KV head
                grad_entry = rows[:, 0] * weights[:, 0, m, None]
                for g in range(1, rows.shape[1]):
                    grad_entry.addcmul_(rows[:, g], weights[:, g, m, None])
                grads.append(_from_rows(grad_entry.view(batch * q_len, num_kv_heads, head_dim), batch, q_len)
                             .to(entry.dtype))
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), grad_mask, grad_keys, grad_values


def _kernel_forward(q, k, v, keys, values, attention_mask, scale, causal, backend):
    """``(out, lse, lse_seq)`` of the ``"torch"`` or ``"triton"`` forward, no autograd (the Triton path stacks the
    entries transiently; its lse is the joint one, which the backward reads as both)."""
    if backend == "triton":
        out, lse = triton_moda_forward(q, k, v, *(_stack(x, q, k.shape[1]) for x in (keys, values)), attention_mask,
                                       scale, causal)
        return out, lse, lse
    return torch_moda_forward(q, k, v, keys, values, attention_mask, scale, causal)


class _MoDAFunction(torch.autograd.Function):
    """MoDA on the ``"torch"`` or ``"triton"`` path with autograd: ``apply(q, k, v, attention_mask, scale, causal,
    backend, num_keys, *entries)``, ``entries`` = the window's keys then values, each [B, Hkv, T, d]. Saves q, k, v,
    the mask, the output, the log-sum-exp(s) and references to the entries."""

    @staticmethod
    def forward(ctx, q, k, v, attention_mask, scale, causal, backend, num_keys, *entries):  # noqa: D102
        keys, values = entries[:num_keys], entries[num_keys:]
        out, lse, lse_seq = _kernel_forward(q, k, v, keys, values, attention_mask, scale, causal, backend)
        ctx.save_for_backward(q, k, v, attention_mask, out, lse, lse_seq, *entries)
        ctx.scale, ctx.causal, ctx.backend, ctx.num_keys = scale, causal, backend, num_keys
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, attention_mask, out, lse, lse_seq, *entries = ctx.saved_tensors
        keys, values = entries[:ctx.num_keys], entries[ctx.num_keys:]
        if ctx.backend == "triton" and not torch.is_grad_enabled() and not ctx.needs_input_grad[3]:
            stacked = [_stack(x, q, k.shape[1]) for x in (keys, values)]
            grad_q, grad_k, grad_v, _, grad_depth_k, grad_depth_v = triton_moda_backward(
                grad_out, q, k, v, *stacked, attention_mask, out, lse, ctx.scale, ctx.causal)
            grad_keys = [g.transpose(1, 2) for g in grad_depth_k.unbind(3)]
            grad_values = [g.transpose(1, 2) for g in grad_depth_v.unbind(3)]
            grad_mask = None
        else:
            grad_q, grad_k, grad_v, grad_mask, grad_keys, grad_values = torch_moda_backward(
                grad_out, q, k, v, keys, values, attention_mask, out, lse, lse_seq, ctx.scale, ctx.causal)
        return grad_q, grad_k, grad_v, grad_mask, None, None, None, None, *grad_keys, *grad_values


def moda_attention_weights(q, k, keys, attention_mask, scale, causal):
    """The joint softmax weights [B, Hq, T, S + M] (sequence columns first; fp32, fp64 for fp64 inputs; zeros for a
    row with no visible entry) with autograd, for q [B, Hq, T, d], k [B, Hkv, S, d], M keys [B, Hkv, T, d]."""
    batch, num_q_heads, q_len, _ = q.shape
    seq = _masked_logits(q, k, attention_mask, scale, causal).flatten(1, 2)  # (B, Hq, T, S)
    depth = _depth_dots(_rows(q, k.shape[1]).to(seq.dtype), [_entry_rows(e, seq.dtype) for e in keys]) * scale
    logits = torch.cat([seq, _from_rows(depth, batch, q_len)], dim=-1)
    return torch.exp(logits - _finite_or_inf(torch.logsumexp(logits, dim=-1)).unsqueeze(-1))


def _weights_times_values(weights, v, values):
    """[B, Hq, T, d] = weights [B, Hq, T, S + M] (sequence columns first) times [V_seq ; the token's M values]."""
    kv_len, num_kv_heads, work = v.shape[2], v.shape[1], weights.dtype
    out = torch.matmul(weights[..., :kv_len].unflatten(1, (num_kv_heads, -1)), v.to(work).unsqueeze(2)).flatten(1, 2)
    if not values:
        return out
    depth_values = torch.cat([_entry_rows(e, work) for e in values], dim=-1).transpose(1, 2)  # (N, M, d)
    depth = torch.bmm(_rows(weights[..., kv_len:], num_kv_heads), depth_values)  # (N, G, d)
    return out + _from_rows(depth, weights.shape[0], weights.shape[2])


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
                   return_weights: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
    Returns [B, Hq, T, d] in the compute dtype, differentiable twice (or ``(out, weights)``); a row with no
    visible entry is zeros. Raises ValueError for a shape, dtype, device or scale that does not fit (naming the
    argument and what it must be), and for an unknown backend or one that cannot run here.
    """
    # the depth as M entries [B, Hkv, T, d] (a [B, Hkv, T, M, d] tensor as views; a wrong rank fails the entry check)
    keys, values = (x.unbind(3) if torch.is_tensor(x) and x.dim() == 5 else tuple(x) for x in (depth_k, depth_v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None and q.dim() == 4 and q.shape[-1] > 0 else scale
    _check_inputs(q, k, v, keys, values, attention_mask, scale)
    dtypes = {x.dtype for x in (q, k, v, *keys, *values)}
    autocast = _autocast_dtype(q.device.type) if torch.float64 not in dtypes else None
    dtype = autocast if autocast is not None else functools.reduce(torch.promote_types, dtypes)
    if dtypes != {dtype}:  # (no pass over the inputs when they all have it)
        q, k, v, *entries = (x if x.dtype == dtype else x.to(dtype) for x in (q, k, v, *keys, *values))
        keys, values = tuple(entries[:len(keys)]), tuple(entries[len(keys):])
    scale, causal = float(scale), bool(causal)
    backend = resolve_backend(backend, q.device)
    grad = torch.is_grad_enabled()
    needs_grad = grad and any(x.requires_grad for x in (q, k, v, *keys, *values, attention_mask) if x is not None)
    if backend == "triton" and (dtype == torch.float64  # the kernels accumulate in fp32; no mask gradient
                                or grad and attention_mask is not None and attention_mask.requires_grad):
        backend = "torch"
    with torch.autocast(q.device.type, enabled=False) if autocast is not None else contextlib.nullcontext():
        weights = None
        if q.shape[0] * q.shape[2] == 0:  # no queries: zeros, connected to every input (zero gradients)
            out = q.new_zeros(q.shape) + sum(x[:0].sum() for x in (q, k, v, *keys, *values))
        elif return_weights:  # the output from the weights (as Llama's eager attention): they are in its graph
            weights = moda_attention_weights(q, k, keys, attention_mask, scale, causal)
            out = _weights_times_values(weights, v, values).to(dtype)
        elif backend == "torch" and q.shape[2] == 1 and attention_mask is None and not needs_grad:
            # A decoding step: the one query token's joint softmax is one SDPA over [sequence | its depth entries].
            out = torch.nn.functional.scaled_dot_product_attention(
                q, torch.cat([k, *keys], dim=2), torch.cat([v, *values], dim=2), scale=scale,
                enable_gqa=q.shape[1] != k.shape[1])
        elif backend == "reference":
            stacked = [torch.stack(x, dim=3) if x else q.new_zeros(*k.shape[:2], q.shape[2], 0, q.shape[3])
                       for x in (keys, values)]
            out = moda_reference(q, k, v, *stacked, attention_mask, scale, causal)
        elif not needs_grad:  # the forward alone (torch.compile 2.13 mis-binds two entries of a Function in no_grad)
            out = _kernel_forward(q, k, v, keys, values, attention_mask, scale, causal, backend)[0]
        else:
            out = _MoDAFunction.apply(q, k, v, attention_mask, scale, causal, backend, len(keys), *keys, *values)
        for depth in (depth_k, depth_v):
            if isinstance(depth, torch.Tensor) and not keys:  # an empty [B, Hkv, T, 0, d]: keep it in the graph
                out = out + depth.sum().to(out.dtype)  # (an exact 0)
        if not return_weights:
            return out
    return out, weights if weights is not None else moda_attention_weights(q, k, keys, attention_mask, scale, causal)


__all__ = ["moda_attention", "moda_attention_weights", "moda_reference", "resolve_backend"]
