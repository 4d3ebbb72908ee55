"""Fused Triton forward and backward for MoDA attention (FlashAttention-2 style).

``triton_moda_attention(q, k, v, depth_k, depth_v, attention_mask, scale, causal)`` computes, for
every query token, ONE softmax over (a) the causal sequence keys and (b) the token's own ``M``
depth keys, exactly like ``moda_attention(..., backend="reference")``:

- ``q``        [B, Hq, T, d]       queries; query ``i`` sits at sequence position ``S - T + i``
- ``k``, ``v`` [B, Hkv, S, d]      sequence keys / values (S >= T: prefill or cached decoding)
- ``depth_k``, ``depth_v`` [B, Hkv, T, M, d]   depth entries, token-major (token ``i``'s own M)
- ``attention_mask``  bool (True = attend) or additive float, broadcastable to [B, Hq, T, S];
  applies to the sequence pool only. ``None`` for no mask.
- returns      [B, Hq, T, d] in ``q``'s dtype; a row with no visible key returns zeros.

Kernel design (the paper's "hardware-efficient MoDA", Sec. 3.2-3.3):

- One program per (query block of ``BLOCK_T`` tokens, batch x KV head). The program's rows are
  the ``BLOCK_T`` tokens times *all* ``G = Hq / Hkv`` query heads of that KV head
  (row ``r`` -> token ``r // G_PAD``, head ``r % G_PAD``; the paper's group-aware indexing), so
  every sequence and depth KV block is loaded once per group, not once per query head.
- Sequence phase: KV blocks fully visible to every row run without a causal mask; the blocks on
  the causal diagonal apply it; blocks past the causal limit are never visited.
- Depth phase: the program reads only its own ``BLOCK_T * M`` depth slice (chunk-aware layout;
  ``depth_k[b, h]`` is already token-major), and a row scores only the ``M`` entries of its own
  token. Both phases share the online-softmax state ``(m, l, acc)``. Two forms: tensor-core dots
  over the chunk with a block-diagonal mask (the paper's; G / (BLOCK_T * G_PAD) of the products
  are useful, good when G is large), or, for small G, a loop over the M entries where each row
  dots its own token's entry on the CUDA cores (no wasted products).
- No [T, S] matrix in memory; fp32 accumulation; fp16 / bf16 / fp32 inputs (fp32 dots use IEEE
  precision, not TF32; under the interpreter bf16 dot operands are upcast, see ``_dot``).
  ``d`` need not be a power of two (padded to ``BLOCK_D`` with masks).
- The mask is read tile by tile through its broadcast strides: a [B, 1, 1, S] padding mask is
  never expanded. A bool mask is converted once to an additive fp32 mask of its own shape.
- Backward (FA2 recompute from the per-row log-sum-exp): ``delta = rowsum(dO * O)`` in PyTorch;
  kernel 1 (grid over query blocks) gives dQ and the depth dK / dV, which are complete inside a
  program because every row that can see a depth entry belongs to it (no atomics); kernel 2
  (grid over sequence KV blocks, looping over the query blocks that can see the block, all G heads
  at once) gives the sequence dK / dV. Gradients are written once, in the inputs' dtypes.

Not covered by the kernels (``moda_attention`` routes these calls to the PyTorch path; this module
never imports it): float64; a float mask that needs a gradient. Second-order gradients are computed
by recomputing through a caller-supplied twice-differentiable op (``second_order``), else refused.
Depth entries are read, and their gradients written, through strides: ``depth_k`` may be a strided
view of a larger buffer (the model's depth stream passes a window of its slot-major buffer).
:func:`triton_moda_forward` / :func:`triton_moda_backward` expose the
two halves without autograd for callers that own the backward (the model's depth stream).

Known limit: a decoding step (T = 1) launches only B * Hkv programs, each scanning all S keys
(no split-S "flash-decoding"), so long-cache decoding underfills a large GPU.
The tile sizes and the DEPTH_DOT switch are set by rule, not tuned on a GPU.

Triton is optional: without it this module still imports (the kernels are defined against a
tiny stand-in and never launched) and :func:`moda_triton_available` returns ``False``. Under
``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU tensors.

This file must stay self-contained (torch, optional triton): it is copied as remote code.
"""

from __future__ import annotations

import math
import os

import torch

try:  # Triton is optional: importing this module must never fail without it.
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    _HAS_TRITON = False

    class _TritonStandIn:
        """Lets the ``@triton.jit`` definitions below evaluate when Triton is missing (never launched)."""

        @staticmethod
        def jit(fn=None, **kwargs):
            return fn if fn is not None else (lambda f: f)

    class _TritonLanguageStandIn:
        constexpr = int

    triton = _TritonStandIn()  # type: ignore[assignment]
    tl = _TritonLanguageStandIn()  # type: ignore[assignment]

__all__ = [
    "TRITON_MODA_DTYPES",
    "moda_triton_available",
    "moda_triton_runs_on",
    "triton_moda_attention",
    "triton_moda_backward",
    "triton_moda_forward",
]

_LOG2E = 1.4426950408889634
TRITON_MODA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the kernels compute


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def moda_triton_available() -> bool:
    """True when Triton imports and can run: a CUDA device, or ``TRITON_INTERPRET=1`` (CPU tensors)."""
    return _HAS_TRITON and (torch.cuda.is_available() or _interpreting())


def moda_triton_runs_on(device: torch.device) -> bool:
    """True when the kernels can run on tensors of ``device``: CUDA, or CPU under ``TRITON_INTERPRET=1``."""
    return moda_triton_available() and (device.type == "cuda" or (_interpreting() and device.type == "cpu"))


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` with fp32 accumulation. ``UPCAST`` (interpreter + bf16 only): the Triton 3.x
    interpreter stores bf16 as uint16 and its ``dot`` then multiplies the raw integers, so the
    operands go to fp32 first. Products of bf16 values are exact in fp32, as on tensor cores."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=INPUT_PRECISION)


@triton.jit
def _moda_fwd_seq_inner(
    b_acc, b_l, b_m, b_q,
    p_k, p_v, p_mask,
    o_t, m_r, o_d, m_d,
    s_lo, s_hi, T, S, qk_scale,
    s_ks, s_kd, s_vs, s_vd, s_ms,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ON_BOUNDARY: tl.constexpr,
    BLOCK_S: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Online-softmax update over sequence keys [s_lo, s_hi); logits are kept in the log2 domain."""
    for s_start in range(s_lo, s_hi, BLOCK_S):
        o_s = s_start + tl.arange(0, BLOCK_S)
        m_s = o_s < S
        # [BLOCK_D, BLOCK_S] and [BLOCK_S, BLOCK_D]
        b_kt = tl.load(p_k + o_s[None, :] * s_ks + o_d[:, None] * s_kd, mask=m_d[:, None] & m_s[None, :], other=0.0)
        b_v = tl.load(p_v + o_s[:, None] * s_vs + o_d[None, :] * s_vd, mask=m_s[:, None] & m_d[None, :], other=0.0)
        b_s = _dot(b_q, b_kt, INPUT_PRECISION, UPCAST) * qk_scale
        if HAS_MASK:
            b_mask = tl.load(p_mask + o_s[None, :] * s_ms, mask=m_r[:, None] & m_s[None, :], other=0.0)
            b_s += b_mask * 1.4426950408889634  # additive mask, moved to the log2 domain
        if ON_BOUNDARY:
            m_vis = m_s[None, :]
            if CAUSAL:
                m_vis = m_vis & (o_s[None, :] <= (S - T + o_t)[:, None])
            b_s = tl.where(m_vis, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.math.exp2(b_s - b_m_safe[:, None])
        b_alpha = tl.math.exp2(b_m - b_m_safe)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v, INPUT_PRECISION, UPCAST)
        b_m = b_m_new
    return b_acc, b_l, b_m


@triton.jit
def _moda_fwd_kernel(
    q, k, v, dk, dv, mask, o, lse,
    s_qb, s_qh, s_qt, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_dkb, s_dkh, s_dkt, s_dkm, s_dkd,
    s_dvb, s_dvh, s_dvt, s_dvm, s_dvd,
    s_mb, s_mh, s_mt, s_ms,
    Hkv, T, S, M, D, G, qk_scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DM: tl.constexpr,
    BLOCK_D: tl.constexpr, DEPTH_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program: BLOCK_T query tokens x all G query heads of one (batch, KV head).

    Writes ``o`` [B, Hq, T, D] (contiguous) and ``lse`` [B, Hq, T] (contiguous, fp32, log2 domain;
    +inf for a row with no visible key, so that the backward's probabilities vanish there).
    """
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    # int64 batch / head indices: every offset built from them is int64 (tensors may exceed 2**31 elements).
    i_b, i_hkv = (i_bh // Hkv).to(tl.int64), (i_bh % Hkv).to(tl.int64)
    Hq = Hkv * G
    BLOCK_R: tl.constexpr = BLOCK_T * G_PAD

    o_r = tl.arange(0, BLOCK_R)
    o_t = i_t * BLOCK_T + o_r // G_PAD  # query token of each row
    o_g = o_r % G_PAD
    o_h = i_hkv * G + o_g  # query head of each row
    m_r = (o_t < T) & (o_g < G)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D

    p_q = q + i_b * s_qb + o_h[:, None] * s_qh + o_t[:, None] * s_qt + o_d[None, :] * s_qd
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)

    b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)

    p_k = k + i_b * s_kb + i_hkv * s_kh
    p_v = v + i_b * s_vb + i_hkv * s_vh
    p_mask = mask + i_b * s_mb + o_h[:, None] * s_mh + o_t[:, None].to(tl.int64) * s_mt  # T * S may pass 2**31

    # Sequence phase. Keys < s_full are visible to every row of the block (no causal mask needed);
    # [s_full, s_hi) needs the causal / bounds mask; keys >= s_hi are visible to no row.
    t_first = i_t * BLOCK_T
    t_last = tl.minimum(t_first + BLOCK_T, T) - 1
    if CAUSAL:
        s_hi = S - T + t_last + 1
        s_full = (S - T + t_first + 1) // BLOCK_S * BLOCK_S
    else:
        s_hi = S
        s_full = S // BLOCK_S * BLOCK_S
    b_acc, b_l, b_m = _moda_fwd_seq_inner(
        b_acc, b_l, b_m, b_q, p_k, p_v, p_mask, o_t, m_r, o_d, m_d, 0, s_full, T, S, qk_scale,
        s_ks, s_kd, s_vs, s_vd, s_ms, CAUSAL, HAS_MASK, False, BLOCK_S, INPUT_PRECISION, UPCAST,
    )
    b_acc, b_l, b_m = _moda_fwd_seq_inner(
        b_acc, b_l, b_m, b_q, p_k, p_v, p_mask, o_t, m_r, o_d, m_d, s_full, s_hi, T, S, qk_scale,
        s_ks, s_kd, s_vs, s_vd, s_ms, CAUSAL, HAS_MASK, True, BLOCK_S, INPUT_PRECISION, UPCAST,
    )

    # Depth phase: this block's chunk of the token-major depth axis, j in [t_first*M, (t_last+1)*M).
    p_dk = dk + i_b * s_dkb + i_hkv * s_dkh
    p_dv = dv + i_b * s_dvb + i_hkv * s_dvh
    j_lo = t_first * M
    j_hi = (t_last + 1) * M
    if DEPTH_DOT:
        # Tensor-core form (the paper's): [rows x chunk] logits with a block-diagonal token mask;
        # 1 / BLOCK_T of the products are kept, which pays off when BLOCK_T is small (G large).
        for j_start in range(j_lo, j_hi, BLOCK_DM):
            o_j = j_start + tl.arange(0, BLOCK_DM)
            m_j = o_j < j_hi
            o_jt = (o_j // M).to(tl.int64)  # token that owns depth column j (int64: T * M * d may pass 2**31)
            o_jm = o_j % M
            b_dkt = tl.load(p_dk + o_jt[None, :] * s_dkt + o_jm[None, :] * s_dkm + o_d[:, None] * s_dkd,
                            mask=m_d[:, None] & m_j[None, :], other=0.0)
            b_dv = tl.load(p_dv + o_jt[:, None] * s_dvt + o_jm[:, None] * s_dvm + o_d[None, :] * s_dvd,
                           mask=m_j[:, None] & m_d[None, :], other=0.0)
            b_s = _dot(b_q, b_dkt, INPUT_PRECISION, UPCAST) * qk_scale
            b_s = tl.where((o_t[:, None] == o_jt[None, :]) & m_j[None, :], b_s, float("-inf"))
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
            b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = tl.math.exp2(b_s - b_m_safe[:, None])
            b_alpha = tl.math.exp2(b_m - b_m_safe)
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_dv.dtype), b_dv, INPUT_PRECISION, UPCAST)
            b_m = b_m_new
    else:
        # Per-entry form for large BLOCK_T (small G): row r dots its own token's m-th entry on the
        # CUDA cores, no wasted products. Rows of one token read the same entry (cache hits).
        m_rd = m_r[:, None] & m_d[None, :]
        p_dk_r = p_dk + o_t[:, None].to(tl.int64) * s_dkt + o_d[None, :] * s_dkd
        p_dv_r = p_dv + o_t[:, None].to(tl.int64) * s_dvt + o_d[None, :] * s_dvd
        b_qf = b_q.to(tl.float32)
        for i_m in range(0, M):
            b_dkr = tl.load(p_dk_r + i_m * s_dkm, mask=m_rd, other=0.0).to(tl.float32)
            b_dvr = tl.load(p_dv_r + i_m * s_dvm, mask=m_rd, other=0.0).to(tl.float32)
            b_sm = tl.where(m_r, tl.sum(b_qf * b_dkr, 1) * qk_scale, float("-inf"))  # [BLOCK_R]
            b_m_new = tl.maximum(b_m, b_sm)
            b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_pm = tl.math.exp2(b_sm - b_m_safe)
            b_alpha = tl.math.exp2(b_m - b_m_safe)
            b_l = b_l * b_alpha + b_pm
            b_acc = b_acc * b_alpha[:, None] + b_pm[:, None] * b_dvr
            b_m = b_m_new

    b_has = b_l > 0.0
    b_o = b_acc / tl.where(b_has, b_l, 1.0)[:, None]
    b_lse = tl.where(b_has, b_m + tl.math.log2(tl.where(b_has, b_l, 1.0)), float("inf"))
    o_row = (i_b * Hq + o_h) * T + o_t  # contiguous [B, Hq, T] row index
    tl.store(o + o_row[:, None] * D + o_d[None, :], b_o.to(o.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
    tl.store(lse + o_row, b_lse, mask=m_r)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _moda_bwd_dq_seq_inner(
    b_dq, b_q, b_do, b_lse, b_delta,
    p_k, p_v, p_mask,
    o_t, m_r, o_d, m_d,
    s_lo, s_hi, T, S, qk_scale,
    s_ks, s_kd, s_vs, s_vd, s_ms,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ON_BOUNDARY: tl.constexpr,
    BLOCK_S: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Accumulate dS @ K over sequence keys [s_lo, s_hi) for this program's rows (unscaled)."""
    for s_start in range(s_lo, s_hi, BLOCK_S):
        o_s = s_start + tl.arange(0, BLOCK_S)
        m_s = o_s < S
        b_kt = tl.load(p_k + o_s[None, :] * s_ks + o_d[:, None] * s_kd, mask=m_d[:, None] & m_s[None, :], other=0.0)
        b_vt = tl.load(p_v + o_s[None, :] * s_vs + o_d[:, None] * s_vd, mask=m_d[:, None] & m_s[None, :], other=0.0)
        b_s = _dot(b_q, b_kt, INPUT_PRECISION, UPCAST) * qk_scale
        if HAS_MASK:
            b_mask = tl.load(p_mask + o_s[None, :] * s_ms, mask=m_r[:, None] & m_s[None, :], other=0.0)
            b_s += b_mask * 1.4426950408889634  # additive mask, moved to the log2 domain
        if ON_BOUNDARY:
            m_vis = m_s[None, :]
            if CAUSAL:
                m_vis = m_vis & (o_s[None, :] <= (S - T + o_t)[:, None])
            b_s = tl.where(m_vis, b_s, float("-inf"))
        b_p = tl.math.exp2(b_s - b_lse[:, None])
        b_dp = _dot(b_do, b_vt, INPUT_PRECISION, UPCAST)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += _dot(b_ds.to(b_kt.dtype), tl.trans(b_kt), INPUT_PRECISION, UPCAST)
    return b_dq


@triton.jit
def _moda_bwd_dq_depth_kernel(
    q, k, v, dk, dv, mask, do, lse, delta, dq, ddk, ddv,
    s_qb, s_qh, s_qt, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_dkb, s_dkh, s_dkt, s_dkm, s_dkd,
    s_dvb, s_dvh, s_dvt, s_dvm, s_dvd,
    s_gkb, s_gkh, s_gkt, s_gkm, s_gkd,
    s_gvb, s_gvh, s_gvt, s_gvm, s_gvd,
    s_mb, s_mh, s_mt, s_ms,
    Hkv, T, S, M, D, G, scale, qk_scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DM: tl.constexpr,
    BLOCK_D: tl.constexpr, DEPTH_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """dQ (all G heads of a query block) and the block's depth dK / dV, recomputing P from ``lse``.

    ``do``, ``dq`` are contiguous [B, Hq, T, D]; ``lse``, ``delta`` contiguous [B, Hq, T] fp32;
    ``ddk``, ``ddv`` [B, Hkv, T, M, D] are written through their strides (``s_gk*``, ``s_gv*``), like
    the depth entries ``dk``, ``dv`` are read through theirs (``s_dk*``, ``s_dv*``); with ``ACCUMULATE``
    the gradients are added to what they hold (each entry belongs to exactly one program: no race).
    """
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    # int64 batch / head indices: every offset built from them is int64 (tensors may exceed 2**31 elements).
    i_b, i_hkv = (i_bh // Hkv).to(tl.int64), (i_bh % Hkv).to(tl.int64)
    Hq = Hkv * G
    BLOCK_R: tl.constexpr = BLOCK_T * G_PAD

    o_r = tl.arange(0, BLOCK_R)
    o_t = i_t * BLOCK_T + o_r // G_PAD
    o_g = o_r % G_PAD
    o_h = i_hkv * G + o_g
    m_r = (o_t < T) & (o_g < G)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_rd = m_r[:, None] & m_d[None, :]
    o_row = (i_b * Hq + o_h) * T + o_t

    b_q = tl.load(q + i_b * s_qb + o_h[:, None] * s_qh + o_t[:, None] * s_qt + o_d[None, :] * s_qd,
                  mask=m_rd, other=0.0)
    b_do = tl.load(do + o_row[:, None] * D + o_d[None, :], mask=m_rd, other=0.0).to(b_q.dtype)
    b_lse = tl.load(lse + o_row, mask=m_r, other=float("inf"))
    b_delta = tl.load(delta + o_row, mask=m_r, other=0.0)
    b_dq = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)

    p_k = k + i_b * s_kb + i_hkv * s_kh
    p_v = v + i_b * s_vb + i_hkv * s_vh
    p_mask = mask + i_b * s_mb + o_h[:, None] * s_mh + o_t[:, None].to(tl.int64) * s_mt  # T * S may pass 2**31

    t_first = i_t * BLOCK_T
    t_last = tl.minimum(t_first + BLOCK_T, T) - 1
    if CAUSAL:
        s_hi = S - T + t_last + 1
        s_full = (S - T + t_first + 1) // BLOCK_S * BLOCK_S
    else:
        s_hi = S
        s_full = S // BLOCK_S * BLOCK_S
    b_dq = _moda_bwd_dq_seq_inner(
        b_dq, b_q, b_do, b_lse, b_delta, p_k, p_v, p_mask, o_t, m_r, o_d, m_d, 0, s_full, T, S, qk_scale,
        s_ks, s_kd, s_vs, s_vd, s_ms, CAUSAL, HAS_MASK, False, BLOCK_S, INPUT_PRECISION, UPCAST,
    )
    b_dq = _moda_bwd_dq_seq_inner(
        b_dq, b_q, b_do, b_lse, b_delta, p_k, p_v, p_mask, o_t, m_r, o_d, m_d, s_full, s_hi, T, S, qk_scale,
        s_ks, s_kd, s_vs, s_vd, s_ms, CAUSAL, HAS_MASK, True, BLOCK_S, INPUT_PRECISION, UPCAST,
    )

    # Depth phase: every row that sees a depth entry of this chunk is in this program, so the
    # depth gradients are complete here and are written once.
    p_dk = dk + i_b * s_dkb + i_hkv * s_dkh
    p_dv = dv + i_b * s_dvb + i_hkv * s_dvh
    p_ddk = ddk + i_b * s_gkb + i_hkv * s_gkh
    p_ddv = ddv + i_b * s_gvb + i_hkv * s_gvh
    j_lo = t_first * M
    j_hi = (t_last + 1) * M
    if DEPTH_DOT:
        for j_start in range(j_lo, j_hi, BLOCK_DM):
            o_j = j_start + tl.arange(0, BLOCK_DM)
            m_j = o_j < j_hi
            o_jt = (o_j // M).to(tl.int64)
            o_jm = o_j % M
            m_jd = m_j[:, None] & m_d[None, :]
            b_dkt = tl.load(p_dk + o_jt[None, :] * s_dkt + o_jm[None, :] * s_dkm + o_d[:, None] * s_dkd,
                            mask=m_d[:, None] & m_j[None, :], other=0.0)
            b_dvt = tl.load(p_dv + o_jt[None, :] * s_dvt + o_jm[None, :] * s_dvm + o_d[:, None] * s_dvd,
                            mask=m_d[:, None] & m_j[None, :], other=0.0)
            b_s = _dot(b_q, b_dkt, INPUT_PRECISION, UPCAST) * qk_scale
            b_s = tl.where((o_t[:, None] == o_jt[None, :]) & m_j[None, :], b_s, float("-inf"))
            b_p = tl.math.exp2(b_s - b_lse[:, None])  # [BLOCK_R, BLOCK_DM]
            b_dp = _dot(b_do, b_dvt, INPUT_PRECISION, UPCAST)
            b_ds = b_p * (b_dp - b_delta[:, None])
            b_dq += _dot(b_ds.to(b_dkt.dtype), tl.trans(b_dkt), INPUT_PRECISION, UPCAST)
            b_ddv = _dot(tl.trans(b_p.to(b_do.dtype)), b_do, INPUT_PRECISION, UPCAST)
            b_ddk = _dot(tl.trans(b_ds.to(b_q.dtype)), b_q, INPUT_PRECISION, UPCAST) * scale
            p_gk = p_ddk + o_jt[:, None] * s_gkt + o_jm[:, None] * s_gkm + o_d[None, :] * s_gkd
            p_gv = p_ddv + o_jt[:, None] * s_gvt + o_jm[:, None] * s_gvm + o_d[None, :] * s_gvd
            if ACCUMULATE:
                b_ddk += tl.load(p_gk, mask=m_jd, other=0.0).to(tl.float32)
                b_ddv += tl.load(p_gv, mask=m_jd, other=0.0).to(tl.float32)
            tl.store(p_gk, b_ddk.to(ddk.dtype.element_ty), mask=m_jd)
            tl.store(p_gv, b_ddv.to(ddv.dtype.element_ty), mask=m_jd)
    else:
        # Per-entry form (see the forward); the G rows of a token are summed by a reshape.
        p_dk_r = p_dk + o_t[:, None].to(tl.int64) * s_dkt + o_d[None, :] * s_dkd
        p_dv_r = p_dv + o_t[:, None].to(tl.int64) * s_dvt + o_d[None, :] * s_dvd
        o_tt = t_first + tl.arange(0, BLOCK_T)  # the block's tokens
        m_td = (o_tt < T)[:, None] & m_d[None, :]
        p_gk = p_ddk + o_tt[:, None].to(tl.int64) * s_gkt + o_d[None, :] * s_gkd  # [BLOCK_T, BLOCK_D] at m = 0
        p_gv = p_ddv + o_tt[:, None].to(tl.int64) * s_gvt + o_d[None, :] * s_gvd
        b_qf = b_q.to(tl.float32)
        b_dof = b_do.to(tl.float32)
        for i_m in range(0, M):
            b_dkr = tl.load(p_dk_r + i_m * s_dkm, mask=m_rd, other=0.0).to(tl.float32)
            b_dvr = tl.load(p_dv_r + i_m * s_dvm, mask=m_rd, other=0.0).to(tl.float32)
            b_sm = tl.where(m_r, tl.sum(b_qf * b_dkr, 1) * qk_scale, float("-inf"))
            b_pm = tl.math.exp2(b_sm - b_lse)  # [BLOCK_R]
            b_dsm = b_pm * (tl.sum(b_dof * b_dvr, 1) - b_delta)
            b_dq += b_dsm[:, None] * b_dkr
            b_ddv = tl.sum(tl.reshape(b_pm[:, None] * b_dof, [BLOCK_T, G_PAD, BLOCK_D]), 1)
            b_ddk = tl.sum(tl.reshape(b_dsm[:, None] * b_qf, [BLOCK_T, G_PAD, BLOCK_D]), 1) * scale
            if ACCUMULATE:
                b_ddk += tl.load(p_gk + i_m * s_gkm, mask=m_td, other=0.0).to(tl.float32)
                b_ddv += tl.load(p_gv + i_m * s_gvm, mask=m_td, other=0.0).to(tl.float32)
            tl.store(p_gk + i_m * s_gkm, b_ddk.to(ddk.dtype.element_ty), mask=m_td)
            tl.store(p_gv + i_m * s_gvm, b_ddv.to(ddv.dtype.element_ty), mask=m_td)

    tl.store(dq + o_row[:, None] * D + o_d[None, :], (b_dq * scale).to(dq.dtype.element_ty), mask=m_rd)


@triton.jit
def _moda_bwd_dkdv_kernel(
    q, k, v, mask, do, lse, delta, dk, dv,
    s_qb, s_qh, s_qt, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_mb, s_mh, s_mt, s_ms,
    Hkv, T, S, D, G, scale, qk_scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Sequence dK / dV of one KV block of one (batch, KV head): loops over the query blocks that can
    see it, all G query heads at once. ``dk``, ``dv`` are contiguous [B, Hkv, S, D]."""
    i_s, i_bh = tl.program_id(0), tl.program_id(1)
    # int64 batch / head indices: every offset built from them is int64 (tensors may exceed 2**31 elements).
    i_b, i_hkv = (i_bh // Hkv).to(tl.int64), (i_bh % Hkv).to(tl.int64)
    Hq = Hkv * G
    BLOCK_R: tl.constexpr = BLOCK_T * G_PAD

    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    m_s = o_s < S
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_sd = m_s[:, None] & m_d[None, :]
    b_k = tl.load(k + i_b * s_kb + i_hkv * s_kh + o_s[:, None] * s_ks + o_d[None, :] * s_kd, mask=m_sd, other=0.0)
    b_v = tl.load(v + i_b * s_vb + i_hkv * s_vh + o_s[:, None] * s_vs + o_d[None, :] * s_vd, mask=m_sd, other=0.0)
    b_dk = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)

    # Query token t sees key s iff s <= S - T + t: only tokens t >= s_first - (S - T) matter.
    if CAUSAL:
        t_lo = tl.maximum(i_s * BLOCK_S - (S - T), 0) // BLOCK_T * BLOCK_T
    else:
        t_lo = 0
    o_rr = tl.arange(0, BLOCK_R)
    for t_start in range(t_lo, T, BLOCK_T):
        o_t = t_start + o_rr // G_PAD
        o_g = o_rr % G_PAD
        o_h = i_hkv * G + o_g
        m_r = (o_t < T) & (o_g < G)
        m_rd = m_r[:, None] & m_d[None, :]
        o_row = (i_b * Hq + o_h) * T + o_t
        b_q = tl.load(q + i_b * s_qb + o_h[:, None] * s_qh + o_t[:, None] * s_qt + o_d[None, :] * s_qd,
                      mask=m_rd, other=0.0)
        b_do = tl.load(do + o_row[:, None] * D + o_d[None, :], mask=m_rd, other=0.0).to(b_q.dtype)
        b_lse = tl.load(lse + o_row, mask=m_r, other=float("inf"))
        b_delta = tl.load(delta + o_row, mask=m_r, other=0.0)

        b_s = _dot(b_q, tl.trans(b_k), INPUT_PRECISION, UPCAST) * qk_scale  # [BLOCK_R, BLOCK_S]
        if HAS_MASK:
            p_mask = mask + i_b * s_mb + o_h[:, None] * s_mh + o_t[:, None].to(tl.int64) * s_mt + o_s[None, :] * s_ms
            b_s += tl.load(p_mask, mask=m_r[:, None] & m_s[None, :], other=0.0) * 1.4426950408889634
        m_vis = m_r[:, None] & m_s[None, :]
        if CAUSAL:
            m_vis = m_vis & (o_s[None, :] <= (S - T + o_t)[:, None])
        b_s = tl.where(m_vis, b_s, float("-inf"))
        b_p = tl.math.exp2(b_s - b_lse[:, None])
        b_dv += _dot(tl.trans(b_p.to(b_do.dtype)), b_do, INPUT_PRECISION, UPCAST)
        b_dp = _dot(b_do, tl.trans(b_v), INPUT_PRECISION, UPCAST)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dk += _dot(tl.trans(b_ds.to(b_q.dtype)), b_q, INPUT_PRECISION, UPCAST)

    o_kv = ((i_b * Hkv + i_hkv) * S + o_s)[:, None] * D + o_d[None, :]
    tl.store(dk + o_kv, (b_dk * scale).to(dk.dtype.element_ty), mask=m_sd)
    tl.store(dv + o_kv, b_dv.to(dv.dtype.element_ty), mask=m_sd)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _block_sizes(T: int, G: int, D: int, block_t: int | None, block_s: int | None,
                 depth_dot: bool | None) -> dict[str, int | bool]:
    """Tile sizes and the depth-phase form. Rows per program = BLOCK_T * G_PAD (>= 16 for ``tl.dot``).

    ``DEPTH_DOT``: score the depth chunk with tensor-core dots (keeping 1 / BLOCK_T of the products)
    when BLOCK_T <= 16, i.e. G >= 4 at the default 64 rows; per-entry row dots otherwise. The
    threshold is the FLOP break-even (tensor cores ~16x the CUDA-core rate), not a measured tuning.
    """
    g_pad = _next_pow2(G)
    if block_t is None:
        rows = 64 if D <= 64 else 32
        block_t = max(rows // g_pad, 1)
        # Decoding / short T: no need for more token rows than T (keeping >= 16 rows for tl.dot).
        block_t = max(min(block_t, _next_pow2(T)), max(16 // g_pad, 1))
    elif block_t * g_pad < 16:
        block_t = max(16 // g_pad, 1)
    block_t = _next_pow2(block_t)
    if block_s is None:
        block_s = 64 if D <= 64 else 32
    return {
        "BLOCK_T": block_t,
        "G_PAD": g_pad,
        "BLOCK_S": max(_next_pow2(block_s), 16),
        "BLOCK_DM": max(_next_pow2(block_s), 16),
        "BLOCK_D": max(_next_pow2(D), 16),
        "DEPTH_DOT": bool(block_t <= 16 if depth_dot is None else depth_dot),
    }


def _prepare_mask(attention_mask: torch.Tensor | None, shape: tuple[int, int, int, int],
                  ref: torch.Tensor) -> torch.Tensor | None:
    """Additive fp32 mask broadcast (by strides, no copy of the broadcast) to ``shape`` [B, Hq, T, S]."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        add = torch.zeros(attention_mask.shape, dtype=torch.float32, device=ref.device)
        add = add.masked_fill(~attention_mask.to(ref.device), float("-inf"))
    else:
        add = attention_mask.detach().to(device=ref.device, dtype=torch.float32)
    return torch.broadcast_to(add, shape)


def _dot_flags(dtype: torch.dtype) -> dict[str, object]:
    """fp32 dots in IEEE precision (not TF32); bf16 operands upcast under the interpreter (see ``_dot``)."""
    return {
        "INPUT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST": _interpreting() and dtype == torch.bfloat16,
    }


def _mask_strides(mask: torch.Tensor | None) -> tuple[int, int, int, int]:
    return tuple(mask.stride()) if mask is not None else (0, 0, 0, 0)  # type: ignore[return-value]


def _moda_forward(q, k, v, depth_k, depth_v, mask, scale, causal, blocks):
    B, Hq, T, D = q.shape
    Hkv, S, M = k.shape[1], k.shape[2], depth_k.shape[3]
    G = Hq // Hkv
    o = torch.empty((B, Hq, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(T, blocks["BLOCK_T"]), B * Hkv)
    # With M = 0 the depth loop is empty: pass q in place of the (zero-size) depth tensors.
    _moda_fwd_kernel[grid](
        q, k, v, depth_k if M else q, depth_v if M else q, mask if mask is not None else q, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *depth_k.stride(), *depth_v.stride(), *_mask_strides(mask),
        Hkv, T, S, M, D, G, scale * _LOG2E,
        CAUSAL=causal, HAS_MASK=mask is not None, **_dot_flags(q.dtype), **blocks,
    )
    return o, lse


def _moda_backward(do, q, k, v, depth_k, depth_v, mask, o, lse, scale, causal, blocks, sequence_kv=True,
                   depth_grads_into=None):
    """The five gradients; ``sequence_kv=False`` skips the sequence dK / dV kernel (returns None for them);
    ``depth_grads_into=(gk, gv)`` adds the depth gradients into those tensors (any strides) and returns them."""
    B, Hq, T, D = q.shape
    Hkv, S, M = k.shape[1], k.shape[2], depth_k.shape[3]
    G = Hq // Hkv
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1)  # [B, Hq, T]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if depth_grads_into is None:
        ddk = torch.empty(depth_k.shape, dtype=depth_k.dtype, device=depth_k.device)
        ddv = torch.empty(depth_v.shape, dtype=depth_v.dtype, device=depth_v.device)
    else:
        ddk, ddv = depth_grads_into
    common = dict(CAUSAL=causal, HAS_MASK=mask is not None, **_dot_flags(q.dtype))
    mask_arg = mask if mask is not None else q
    grid = (triton.cdiv(T, blocks["BLOCK_T"]), B * Hkv)
    _moda_bwd_dq_depth_kernel[grid](
        q, k, v, depth_k if M else q, depth_v if M else q, mask_arg, do, lse, delta, dq,
        ddk if M else dq, ddv if M else dq,
        *q.stride(), *k.stride(), *v.stride(), *depth_k.stride(), *depth_v.stride(),
        *ddk.stride(), *ddv.stride(), *_mask_strides(mask),
        Hkv, T, S, M, D, G, scale, scale * _LOG2E, **common, **blocks, ACCUMULATE=depth_grads_into is not None,
    )
    if not sequence_kv:
        return dq, None, None, ddk, ddv
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    kv_blocks = {key: blocks[key] for key in ("BLOCK_T", "G_PAD", "BLOCK_S", "BLOCK_D")}
    grid = (triton.cdiv(S, blocks["BLOCK_S"]), B * Hkv)
    _moda_bwd_dkdv_kernel[grid](
        q, k, v, mask_arg, do, lse, delta, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *_mask_strides(mask),
        Hkv, T, S, D, G, scale, scale * _LOG2E, **common, **kv_blocks,
    )
    return dq, dk, dv, ddk, ddv


def _check_kernel_dtype(q: torch.Tensor) -> None:
    if not _HAS_TRITON:
        raise RuntimeError("the MoDA Triton kernels need Triton, which could not be imported")
    if q.dtype not in TRITON_MODA_DTYPES:
        raise ValueError(
            f"the MoDA Triton kernels take {TRITON_MODA_DTYPES}; got {q.dtype} "
            "(moda_attention routes other dtypes to the PyTorch path)"
        )


def triton_moda_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    *,
    block_t: int | None = None,
    block_s: int | None = None,
    depth_dot: bool | None = None,
) -> tuple[torch.Tensor, tuple]:
    """The kernel forward without autograd: ``(out [B, Hq, T, d], state)`` for :func:`triton_moda_backward`.

    Inputs as in :func:`triton_moda_attention` (validated by the caller; T >= 1), read through their
    strides; ``state`` = (lse [B, Hq, T] fp32, the prepared fp32 mask or None, the tile sizes).
    """
    _check_kernel_dtype(q)
    B, Hq, T, D = q.shape
    mask = _prepare_mask(attention_mask, (B, Hq, T, k.shape[2]), q)
    blocks = _block_sizes(T, Hq // k.shape[1], D, block_t, block_s, depth_dot)
    o, lse = _moda_forward(q, k, v, depth_k, depth_v, mask, float(scale), bool(causal), blocks)
    return o, (lse, mask, blocks)


def triton_moda_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    out: torch.Tensor,
    state: tuple,
    scale: float,
    causal: bool,
    sequence_kv: bool = True,
    depth_grads_into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The kernel backward: ``(dq, dk, dv, d_depth_k, d_depth_v)`` for ``grad_out`` [B, Hq, T, d].

    ``out`` and ``state`` come from :func:`triton_moda_forward` on the same inputs. Each gradient has its
    input's shape (depth gradients of a strided view included); dk, dv are None when ``sequence_kv`` is
    False. ``depth_grads_into=(gk, gv)``: tensors of depth_k's shape and dtype, any strides (e.g. slices
    of a gradient buffer), that the depth gradients are added into in place and returned as. No
    autograd graph is built.
    """
    lse, mask, blocks = state
    return _moda_backward(grad_out, q, k, v, depth_k, depth_v, mask, out, lse, float(scale), bool(causal),
                          blocks, sequence_kv, depth_grads_into)


class _MoDATritonFunction(torch.autograd.Function):
    """Autograd around the kernels. A backward with ``create_graph=True`` (second-order gradients) is
    computed by recomputing the output with ``second_order`` (a twice-differentiable implementation of
    the same op, given by the caller) and differentiating it; without one it raises."""

    @staticmethod
    def forward(ctx, q, k, v, depth_k, depth_v, attention_mask, scale, causal, blocks, second_order):
        o, state = triton_moda_forward(q, k, v, depth_k, depth_v, attention_mask, scale, causal, **blocks)
        ctx.save_for_backward(q, k, v, depth_k, depth_v, o)
        ctx.state, ctx.attention_mask = state, attention_mask
        ctx.scale, ctx.causal, ctx.second_order = scale, causal, second_order
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, depth_k, depth_v, o = ctx.saved_tensors
        needs = ctx.needs_input_grad[:5]
        if torch.is_grad_enabled():  # create_graph=True: the gradients must themselves be differentiable
            if ctx.second_order is None:
                raise RuntimeError(
                    "triton_moda_attention does not support second-order gradients (create_graph=True); "
                    "call moda_attention(..., backend='triton'), which recomputes them with the PyTorch path, "
                    "or use backend='torch' / 'reference'"
                )
            # aliases that only the recomputation reads: the gradient with respect to the inputs themselves would
            # be the total derivative through the caller's graph (one input may depend on another)
            inputs = tuple(x.view_as(x) for x in (q, k, v, depth_k, depth_v))
            out = ctx.second_order(*inputs, ctx.attention_mask, ctx.scale, ctx.causal)
            wanted = [x for x, need in zip(inputs, needs) if need]
            grads = iter(torch.autograd.grad(out, wanted, do, create_graph=True, allow_unused=True))
            result = [next(grads) if need else None for need in needs]
            result = [torch.zeros_like(x) if need and g is None else g for x, need, g in zip(inputs, needs, result)]
        else:
            result = triton_moda_backward(do, q, k, v, depth_k, depth_v, o, ctx.state, ctx.scale, ctx.causal,
                                          sequence_kv=needs[1] or needs[2])
            result = [g if need else None for g, need in zip(result, needs)]
        return (*result, None, None, None, None, None)


def triton_moda_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
    *,
    block_t: int | None = None,
    block_s: int | None = None,
    depth_dot: bool | None = None,
    second_order=None,
) -> torch.Tensor:
    """MoDA attention through the fused Triton kernels; differentiable in q, k, v, depth_k, depth_v.

    The kernel entry point: inputs are NOT validated here (``moda_attention`` validates them and routes
    what the kernel cannot compute, such as float64 or a mask that needs a gradient, to the PyTorch path).

    Args:
        q: [B, Hq, T, d] queries (fp16 / bf16 / fp32); query i sits at sequence position S - T + i.
        k, v: [B, Hkv, S, d] sequence keys / values, S >= T, Hq a multiple of Hkv.
        depth_k, depth_v: [B, Hkv, T, M, d] each token's own depth entries (M may be 0); any strides, e.g.
            ``buffer[lo:hi].permute(1, 3, 2, 0, 4)`` of a slot-major [M_max, B, T, Hkv, d] buffer. Their gradients have
            the same shape.
        attention_mask: bool (True = attend) or additive float, broadcastable to [B, Hq, T, S];
            sequence pool only; any broadcastable shape is read through strides. Not differentiated.
        scale: softmax scale, default 1 / sqrt(d).
        causal: query i sees sequence keys at positions <= S - T + i; all S keys when False.
        block_t, block_s: tile-size overrides (tokens per query block, keys per KV / depth block);
            tests use them to exercise multi-block paths at small sizes.
        depth_dot: force the depth phase's form (tensor-core block-diagonal dots or per-entry row
            dots); default by block size, see ``_block_sizes``.
        second_order: None, or a twice-differentiable function with this op's positional signature
            ``(q, k, v, depth_k, depth_v, attention_mask, scale, causal)`` used to compute
            second-order gradients; with None a backward with ``create_graph=True`` raises RuntimeError.

    Returns:
        [B, Hq, T, d] in q's dtype; rows with no visible key (M = 0, all keys masked) are zeros.

    Raises:
        ValueError: for a dtype other than fp16 / bf16 / fp32. RuntimeError: without Triton.
    """
    _check_kernel_dtype(q)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    tensors = (q, k, v, depth_k, depth_v)
    if q.shape[0] * q.shape[1] * q.shape[2] == 0:
        # Nothing to attend from; zeros that stay connected to every input (zero gradients).
        return q.new_zeros(q.shape) + 0 * sum(t.sum() for t in tensors)
    blocks = {"block_t": block_t, "block_s": block_s, "depth_dot": depth_dot}
    return _MoDATritonFunction.apply(q, k, v, depth_k, depth_v, attention_mask, scale, bool(causal), blocks,
                                     second_order)
