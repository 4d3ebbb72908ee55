"""The PyTorch implementation of MoDA attention (``backend="torch"``): forward and flash-style backward.

:func:`torch_moda_forward` computes the sequence pool (SDPA's fused CPU kernel where it applies, else materialised)
and merges the depth pool into it exactly; :func:`torch_moda_backward` recomputes the probabilities from the
log-sum-exp in differentiable torch ops. ``moda_attention.py`` wraps both in its autograd Function. Self-contained
(only ``torch``): ``save_pretrained`` copies it next to the model code.
"""

from collections.abc import Sequence

import torch

# SDPA's fused CPU kernel; it also returns the row log-sum-exp, which no public API gives.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:  # float64 for float64, else float32 (exact for every input)
    return torch.float64 if dtype == torch.float64 else torch.float32

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


def unresolved_rows(lse: torch.Tensor) -> torch.Tensor:
    """Rows whose log-sum-exp is too large for its dtype to hold ``log(sum)``: ``|lse| >= 0.5 / eps`` (``2**22`` in
    float32, where one ulp is 0.5). Only mask-sized logits get there: a row whose every key carries transformers'
    ``finfo.min`` has ``lse = finfo.min`` exactly, ``log(n)`` rounded away, so ``exp(logit - lse)`` is 1 per key."""
    return torch.isfinite(lse) & (lse.abs() >= 0.5 / torch.finfo(lse.dtype).eps)


def renormaliser(lse: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The factor that makes the weights ``exp(logit - lse)`` of a row sum to 1: ``1 / total`` on
    :func:`unresolved_rows` (the softmax's exact weights, e.g. the mean over n keys that all carry ``finfo.min``, as
    the reference and transformers' attention give), exactly 1 elsewhere (every other row keeps its bits)."""
    return torch.where(unresolved_rows(lse), total.reciprocal(), torch.ones_like(total))


def _sequence_pool(q, k, v, attention_mask, scale, causal):
    """The sequence pool alone, no autograd: ``(out [B, Hq, T, d], lse [B, Hq, T], renorm [B, Hq, T] or None)``; a
    row without a visible key has out 0 and lse ``-inf``. The fused CPU kernel where it applies (its causal
    masking never reads a hidden key), else materialised in the work dtype; ``renorm`` (:func:`renormaliser`) only
    for a float mask, the one source of rows whose log-sum-exp cannot be held (``out`` is already renormalised)."""
    batch, num_q_heads, q_len, head_dim = q.shape
    if _flash_applies(q, k, attention_mask, scale, causal):
        out, lse = _FLASH_CPU(_unit_stride(q), _unit_stride(k), _unit_stride(v), 0.0, causal and q_len > 1,
                              scale=scale)[:2]
        return out, lse, None
    logits = _masked_logits(q, k, attention_mask, scale, causal).flatten(2, 3)  # (B, Hkv, G*T, S)
    lse = torch.logsumexp(logits, dim=-1)
    probs = logits.sub_(_finite_or_inf(lse).unsqueeze(-1)).exp_()
    out = torch.matmul(probs, v.to(probs.dtype))  # (B, Hkv, G*T, d)
    renorm = None
    if attention_mask is not None and attention_mask.is_floating_point():
        renorm = renormaliser(lse, probs.sum(dim=-1))
        out.mul_(renorm.unsqueeze(-1))
        renorm = renorm.view(batch, num_q_heads, q_len)
    return out.view(batch, num_q_heads, q_len, head_dim), lse.view(batch, num_q_heads, q_len), renorm


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


def gate_rows(gate: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """A depth gate [Hq] as [1, Hkv, G, 1], to scale :func:`_depth_dots`' [N, G, M] viewed as [B*T, Hkv, G, M]."""
    return gate.to(dtype).view(1, num_kv_heads, -1, 1)


def joint_lse(lse_seq: torch.Tensor, depth_logits: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The row log-sum-exp of the joint softmax [N, G] from the sequence pool's ``lse_seq`` [N, G] and the depth
    logits [N, G, M], each depth score multiplied by its head's gate (``gate_rows``, [1, Hkv, G, 1], or None);
    ``+inf`` for a row that sees no entry. Differentiable in the gate at 0 too: it enters as a factor, never
    through ``log(gate)``."""
    lse_depth = torch.logsumexp(depth_logits, dim=-1)  # (N, G)
    if gate is None:
        return _finite_or_inf(torch.logaddexp(lse_seq, lse_depth))
    lse_seq, lse_depth = (x.view(-1, *gate.shape[1:3]) for x in (lse_seq, lse_depth))  # (B*T, Hkv, G)
    gate = gate.squeeze(-1)
    shift = torch.maximum(lse_seq, lse_depth + gate.detach().log()).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    total = torch.exp(lse_seq - shift) + gate * torch.exp(lse_depth - shift)
    return _finite_or_inf(shift + total.log()).view(depth_logits.shape[:2])


def torch_moda_forward(q, k, v, keys, values, attention_mask, scale, causal, gate=None):
    """The PyTorch forward, no autograd: ``(out [B, Hq, T, d] in q's dtype, lse, lse_seq, renorm)`` for q [B, Hq, T,
    d], k, v [B, Hkv, S, d], the M entries ``keys``, ``values`` [B, Hkv, T, d] each (read in place), all one dtype,
    and the depth ``gate`` [Hq] (>= 0) or None.

    The sequence pool (out_s, lse_s) merged with the depth logits ``l_m`` (plus ``log gate``): ``lse =
    logaddexp(lse_s, logsumexp_m l_m)`` [B, Hq, T] (work dtype; ``+inf`` for a row that sees no entry), ``out =
    exp(lse_s - lse) out_s + sum_m exp(l_m - lse) v_m``; ``lse_seq`` is lse_s as the pool computed it; ``renorm``
    [B, Hq, T] or None: what the backward multiplies the incoming gradient by (:func:`renormaliser`).
    """
    batch, num_q_heads, q_len, _ = q.shape
    num_kv_heads, work = k.shape[1], _work_dtype(q.dtype)
    out_seq, lse_seq, renorm = _sequence_pool(q, k, v, attention_mask, scale, causal)
    if not keys:
        return out_seq.to(q.dtype), _finite_or_inf(lse_seq.to(work)), lse_seq, renorm
    q_rows, lse_rows = _rows(q, num_kv_heads).to(work), _rows(lse_seq, num_kv_heads).to(work)  # (N, G, d), (N, G)
    logits = _depth_dots(q_rows, [_entry_rows(e, work) for e in keys]).mul_(scale)  # (N, G, M)
    if gate is not None:  # log(0) = -inf: a closed gate's entries get weight exactly 0
        logits.view(-1, num_kv_heads, *logits.shape[1:]).add_(gate_rows(gate, num_kv_heads, work).log())
    lse = joint_lse(lse_rows, logits, None)
    out = _rows(out_seq, num_kv_heads).to(work).mul_((lse_rows - lse).exp_().unsqueeze(-1))  # out_seq is ours
    probs = logits.sub_(lse.unsqueeze(-1)).exp_()
    for m, value in enumerate(values):
        out.addcmul_(_entry_rows(value, work).transpose(1, 2), probs[..., m, None])
    if renorm is not None:  # a row that cannot hold its log-sum-exp sees no depth weight: the pool's factor is its own
        renorm = torch.where(unresolved_rows(lse), _rows(renorm, num_kv_heads), torch.ones_like(lse))
        renorm = _from_rows(renorm, batch, q_len)
    return _from_rows(out, batch, q_len).to(q.dtype), _from_rows(lse, batch, q_len), lse_seq, renorm


def torch_moda_backward(grad_out, q, k, v, keys, values, attention_mask, out, lse, lse_seq, scale, causal, gate=None):
    """The backward of :func:`torch_moda_forward` in differentiable torch ops (``create_graph=True`` works).

    Every joint logit gets ``dS = P (dP - D)``, ``P = exp(logit - lse)``, ``dP = dO . v``, ``D = rowsum(dO out)``.
    Under ``create_graph`` lse is recomputed from the logits (its own dependence on the inputs is differentiated);
    else on the fused kernel's path the sequence pool's gradients are its backward's for ``alpha dO``, ``alpha =
    exp(lse_seq - lse)``: it forms ``alpha P_s (dP - D) = dS``. The gate ``g_h`` multiplies its head's depth scores:
    ``dL/dg_h = sum_{b, t, m} exp(l_m - lse) (dP_m - D)`` (finite at ``g = 0``). Returns ``(dq, dk, dv, d_mask or
    None, d_keys, d_values, d_gate or None)``, the entries' gradients as lists of separate [B, Hkv, T, d] tensors,
    each in its input's dtype.
    """
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, work, second_order = k.shape[1], _work_dtype(q.dtype), torch.is_grad_enabled()
    grad = grad_out.to(work)
    q_rows, grad_rows = _rows(q, num_kv_heads).to(work), _rows(grad, num_kv_heads)  # (N, G, d)
    key_rows, value_rows = [_entry_rows(e, work) for e in keys], [_entry_rows(e, work) for e in values]
    depth_logits = _depth_dots(q_rows, key_rows) * scale  # (N, G, M), without the gate
    gates = None if gate is None else gate_rows(gate, num_kv_heads, work)
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
            lse = _from_rows(joint_lse(lse_rows, depth_logits, gates), batch, q_len)
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
    grad_gate = None if gate is None else torch.zeros_like(gate)
    if keys:
        depth_probs = torch.exp(depth_logits - _rows(lse, num_kv_heads).unsqueeze(-1))  # (N, G, M)
        depth_grad_logits = _depth_dots(grad_rows, value_rows) - _rows(delta, num_kv_heads).unsqueeze(-1)
        if gate is not None:  # depth_probs without the gate: dL/dg; with it (g P, exactly 0 at g = 0): the rest
            # (a row whose lse is mask-sized, padding under an eager mask, overflows there: it does not train the gate)
            depth_probs = depth_probs.masked_fill(unresolved_rows(_rows(lse, num_kv_heads)).unsqueeze(-1), 0.0)
            per_head = (depth_probs * depth_grad_logits).view(-1, num_kv_heads, *depth_probs.shape[1:])
            grad_gate = per_head.sum(dim=(0, 3)).flatten().to(gate.dtype)
            depth_probs = (depth_probs.view(per_head.shape) * gates).view(depth_probs.shape) if second_order else (
                torch.exp((depth_logits.view(per_head.shape) + gates.log()).view(depth_probs.shape)
                          - _rows(lse, num_kv_heads).unsqueeze(-1)))
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
    return (grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), grad_mask, grad_keys, grad_values,
            grad_gate)
