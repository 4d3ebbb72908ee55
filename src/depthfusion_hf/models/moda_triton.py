"""Fused Triton forward and backward for MoDA attention (FlashAttention-2 style), and their launch code.

For every query token ONE softmax over the causal sequence keys and the token's own ``M`` depth keys, exactly as
``moda_attention(..., backend="reference")``; the launchers take the layout of ``moda_attention``'s Function:
``q`` [B, Hq, T, d] (query ``i`` at position ``S - T + i``), ``k``, ``v`` [B, Hkv, S, d], token-major depth entries
``depth_k``, ``depth_v`` [B, T, Hkv, M, d], any strides; a bool or additive mask broadcastable to [B, Hq, T, S]
(sequence pool only, read through its broadcast strides). Outputs: ``out`` [B, Hq, T, d] and the row log-sum-exp
``lse`` [B, Hq, T] (fp32, natural log, ``+inf`` for a row with no visible key).

- One program per (query block of ``BLOCK_T`` tokens, batch x KV head), on ONE grid axis (axis 0 takes 2**31 - 1
  programs; axes 1 and 2 stop at 65535, which B x Hkv alone can pass); its rows are the block's tokens times all
  ``G = Hq / Hkv`` query heads of the KV head (the paper's group-aware indexing, Sec. 3.2-3.3).
- Sequence phase: fully visible KV blocks without a causal mask, the diagonal blocks with it, nothing past it.
  Depth phase: only the block's own ``BLOCK_T * M`` depth slice, either as tensor-core dots with a
  block-diagonal mask (the paper's; large G) or as a loop over the M entries, each row dotting its own token's.
- A hidden key (causal, False, ``-inf``) gets a ``-inf`` logit by replacement, never by addition: a NaN key behind
  the mask contributes nothing. Index x stride products are int64 (they may pass 2**31 elements); the depth loop
  steps its pointers. Launched under the tensors' device (``torch.cuda.device``), on its current stream.
- fp32 accumulation; q, k, v and the entries in one dtype of fp16 / bf16 / fp32 (``moda_attention`` casts at its
  boundary). fp32 dots are TF32 where ``torch.get_float32_matmul_precision()`` allows it (``"high"``,
  ``"medium"``), else IEEE fp32 on the CUDA cores with 16-row tiles (slower, but no large spills: ``_block_sizes``).
  Interpreted, bf16 dot operands are upcast.
- Backward (FA2, recomputed from ``lse``): ``delta = rowsum(dO * O)`` in PyTorch; kernel 1 (query blocks) gives dQ
  and the depth dK / dV, complete in one program (every row that sees an entry is in it: no atomics); kernel 2
  (KV blocks, looping over the query blocks that see them) gives the sequence dK / dV.

Known limit: a decoding step (T = 1) launches only B * Hkv programs, each scanning all S keys (no split-S
"flash-decoding"). Tiles, warps and the depth form are set by rule (``_block_sizes``), checked ahead of time for
register spills, not tuned on a GPU. Triton is optional: without it this module imports (the kernels are
defined against a stand-in, never launched) and :func:`moda_triton_available` is False; under
``TRITON_INTERPRET=1`` (set before the import) the kernels run on CPU tensors. Self-contained (torch, optional
triton; it never imports ``moda_attention``): it is copied as remote code.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["moda_triton_available", "moda_triton_runs_on", "triton_moda_backward", "triton_moda_forward"]

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




@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """``tl.dot`` with fp32 accumulation (TF32 for fp32 operands). ``UPCAST``: IEEE fp32 dots, for fp32 inputs where
    TF32 is not allowed and for bf16 in the interpreter (Triton 3.x stores bf16 as uint16 there and its ``dot``
    multiplies the raw integers; products of bf16 values are exact in fp32, as on tensor cores)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _hide(b_s, p_mask, m_tile, HAS_MASK: tl.constexpr):
    """Add the additive mask tile (log2 domain) to the logits; a ``-inf`` mask entry REPLACES the logit. A finite
    entry below ``-FLT_MAX / log2(e)`` (transformers' ``finfo.min``) stays finite: ``-FLT_MAX``, not ``-inf`` (a row
    of only such keys is their mean, as the reference's rounded softmax, not a row with nothing visible)."""
    if HAS_MASK:
        b_mask = tl.load(p_mask, mask=m_tile, other=0.0)
        b_add = tl.maximum(b_mask * 1.4426950408889634, -3.4028234663852886e38)
        b_s = tl.where(b_mask == float("-inf"), float("-inf"), b_s + b_add)
    return b_s


@triton.jit
def _seq_bounds(i_t, T, S, CAUSAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """The query block's tokens [t_first, t_last] and its sequence keys: those < s_full are visible to every row
    (no causal mask needed), [s_full, s_hi) need the causal / bounds mask, keys >= s_hi are visible to none."""
    t_first = i_t * BLOCK_T
    t_last = tl.minimum(t_first + BLOCK_T, T) - 1
    if CAUSAL:
        return t_first, t_last, (S - T + t_first + 1) // BLOCK_S * BLOCK_S, S - T + t_last + 1
    return t_first, t_last, S // BLOCK_S * BLOCK_S, S


@triton.jit
def _program_ids(n_blocks):
    """(block index, batch x KV head index) of this program on the folded 1-d grid; the last (largest causal)
    blocks first."""
    pid = tl.program_id(0)
    return n_blocks - 1 - pid % n_blocks, pid // n_blocks


@triton.jit
def _moda_fwd_seq_inner(
    b_acc, b_l, b_m, b_q, p_k, p_v, p_mask, o_t, m_r, o_d, m_d, s_lo, s_hi, T, S, qk_scale,
    s_ks, s_kd, s_vs, s_vd, s_ms,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ON_BOUNDARY: tl.constexpr, BLOCK_S: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online-softmax update over sequence keys [s_lo, s_hi); logits are kept in the log2 domain."""
    for s_start in range(s_lo, s_hi, BLOCK_S):
        o_s = (s_start + tl.arange(0, BLOCK_S)).to(tl.int64)
        m_s = o_s < S
        b_kt = tl.load(p_k + o_s[None, :] * s_ks + o_d[:, None] * s_kd, mask=m_d[:, None] & m_s[None, :], other=0.0)
        b_v = tl.load(p_v + o_s[:, None] * s_vs + o_d[None, :] * s_vd, mask=m_s[:, None] & m_d[None, :], other=0.0)
        b_s = _dot(b_q, b_kt, UPCAST) * qk_scale
        b_s = _hide(b_s, p_mask + o_s[None, :] * s_ms, m_r[:, None] & m_s[None, :], HAS_MASK)
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
        b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v, UPCAST)
        b_m = b_m_new
    return b_acc, b_l, b_m


@triton.jit
def _moda_fwd_kernel(
    q, k, v, dk, dv, mask, lg, o, lse, renorm,
    s_qb, s_qh, s_qt, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_dkb, s_dkh, s_dkt, s_dkm, s_dkd,
    s_dvb, s_dvh, s_dvt, s_dvm, s_dvd,
    s_mb, s_mh, s_mt, s_ms,
    Hkv, T, S, M, D, G, qk_scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_GATE: tl.constexpr,
    BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DM: tl.constexpr,
    BLOCK_D: tl.constexpr, DEPTH_DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program: BLOCK_T query tokens x all G query heads of one (batch, KV head).

    Writes ``o`` [B, Hq, T, D] and ``lse`` [B, Hq, T] (both contiguous; lse fp32, log2 domain, +inf for a row
    with no visible key); with a mask also ``renorm`` [B, Hq, T]: ``1 / sum_j exp2(s_j - lse)`` on rows whose
    ``|lse| >= 2**22`` (fp32 cannot hold their ``log2(l)``: mask-sized logits), else exactly 1. ``lg``: the depth
    gate as ``log2 g`` [Hq] (``HAS_GATE``), added to the head's depth logits.
    """
    i_t, i_bh = _program_ids(tl.cdiv(T, BLOCK_T))
    i_b, i_hkv = (i_bh // Hkv).to(tl.int64), (i_bh % Hkv).to(tl.int64)
    Hq = Hkv * G
    BLOCK_R: tl.constexpr = BLOCK_T * G_PAD

    o_r = tl.arange(0, BLOCK_R)
    o_t = (i_t * BLOCK_T + o_r // G_PAD).to(tl.int64)  # query token of each row
    o_g = o_r % G_PAD
    o_h = i_hkv * G + o_g  # query head of each row
    m_r = (o_t < T) & (o_g < G)
    o_d = tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = o_d < D

    p_q = q + i_b * s_qb + o_h[:, None] * s_qh + o_t[:, None] * s_qt + o_d[None, :] * s_qd
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)

    b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)

    p_k = k + i_b * s_kb + i_hkv * s_kh
    p_v = v + i_b * s_vb + i_hkv * s_vh
    p_mask = mask + i_b * s_mb + o_h[:, None] * s_mh + o_t[:, None] * s_mt

    # Sequence phase: the blocks visible to every row without a mask, then the diagonal ones with it.
    t_first, t_last, s_full, s_hi = _seq_bounds(i_t, T, S, CAUSAL, BLOCK_T, BLOCK_S)
    b_acc, b_l, b_m = _moda_fwd_seq_inner(
        b_acc, b_l, b_m, b_q, p_k, p_v, p_mask, o_t, m_r, o_d, m_d, 0, s_full, T, S, qk_scale,
        s_ks, s_kd, s_vs, s_vd, s_ms, CAUSAL, HAS_MASK, False, BLOCK_S, UPCAST,
    )
    b_acc, b_l, b_m = _moda_fwd_seq_inner(
        b_acc, b_l, b_m, b_q, p_k, p_v, p_mask, o_t, m_r, o_d, m_d, s_full, s_hi, T, S, qk_scale,
        s_ks, s_kd, s_vs, s_vd, s_ms, CAUSAL, HAS_MASK, True, BLOCK_S, UPCAST,
    )

    # Depth phase: this block's chunk of the token-major depth axis, j in [t_first*M, (t_last+1)*M).
    p_dk = dk + i_b * s_dkb + i_hkv * s_dkh
    p_dv = dv + i_b * s_dvb + i_hkv * s_dvh
    j_lo = t_first * M
    j_hi = (t_last + 1) * M
    b_lg = tl.load(lg + o_h, mask=m_r, other=0.0) if HAS_GATE else tl.zeros([BLOCK_R], dtype=tl.float32)
    if DEPTH_DOT:
        # Tensor-core form (the paper's): [rows x chunk] logits with a block-diagonal token mask.
        for j_start in range(j_lo, j_hi, BLOCK_DM):
            o_j = j_start + tl.arange(0, BLOCK_DM)
            m_j = o_j < j_hi
            o_jt = (o_j // M).to(tl.int64)  # token that owns depth column j
            o_jm = (o_j % M).to(tl.int64)
            b_dkt = tl.load(p_dk + o_jt[None, :] * s_dkt + o_jm[None, :] * s_dkm + o_d[:, None] * s_dkd,
                            mask=m_d[:, None] & m_j[None, :], other=0.0)
            b_dv = tl.load(p_dv + o_jt[:, None] * s_dvt + o_jm[:, None] * s_dvm + o_d[None, :] * s_dvd,
                           mask=m_j[:, None] & m_d[None, :], other=0.0)
            b_s = _dot(b_q, b_dkt, UPCAST) * qk_scale + b_lg[:, None]
            b_s = tl.where((o_t[:, None] == o_jt[None, :]) & m_j[None, :], b_s, float("-inf"))
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
            b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = tl.math.exp2(b_s - b_m_safe[:, None])
            b_alpha = tl.math.exp2(b_m - b_m_safe)
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_dv.dtype), b_dv, UPCAST)
            b_m = b_m_new
    else:
        # Per-entry form for large BLOCK_T (small G): row r dots its own token's m-th entry on the
        # CUDA cores, no wasted products. Rows of one token read the same entry (cache hits).
        m_rd = m_r[:, None] & m_d[None, :]
        p_dk_r = p_dk + o_t[:, None] * s_dkt + o_d[None, :] * s_dkd
        p_dv_r = p_dv + o_t[:, None] * s_dvt + o_d[None, :] * s_dvd
        b_qf = b_q.to(tl.float32)
        for _ in range(0, M):  # the pointers step one entry at a time: no index x stride product
            b_dkr = tl.load(p_dk_r, mask=m_rd, other=0.0).to(tl.float32)
            b_dvr = tl.load(p_dv_r, mask=m_rd, other=0.0).to(tl.float32)
            p_dk_r += s_dkm
            p_dv_r += s_dvm
            b_sm = tl.where(m_r, tl.sum(b_qf * b_dkr, 1) * qk_scale + b_lg, float("-inf"))  # [BLOCK_R]
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
    if HAS_MASK:
        b_unresolved = b_has & (tl.abs(b_lse) >= 4194304.0)
        b_total = b_l * tl.math.exp2(b_m - tl.where(b_unresolved, b_lse, b_m))
        tl.store(renorm + o_row, tl.where(b_unresolved, 1.0 / b_total, 1.0), mask=m_r)




@triton.jit
def _moda_bwd_dq_seq_inner(
    b_dq, b_q, b_do, b_lse, b_delta, p_k, p_v, p_mask, o_t, m_r, o_d, m_d, s_lo, s_hi, T, S, qk_scale,
    s_ks, s_kd, s_vs, s_vd, s_ms,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ON_BOUNDARY: tl.constexpr, BLOCK_S: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Accumulate dS @ K over sequence keys [s_lo, s_hi) for this program's rows (unscaled)."""
    for s_start in range(s_lo, s_hi, BLOCK_S):
        o_s = (s_start + tl.arange(0, BLOCK_S)).to(tl.int64)
        m_s = o_s < S
        b_kt = tl.load(p_k + o_s[None, :] * s_ks + o_d[:, None] * s_kd, mask=m_d[:, None] & m_s[None, :], other=0.0)
        b_vt = tl.load(p_v + o_s[None, :] * s_vs + o_d[:, None] * s_vd, mask=m_d[:, None] & m_s[None, :], other=0.0)
        b_s = _dot(b_q, b_kt, UPCAST) * qk_scale
        b_s = _hide(b_s, p_mask + o_s[None, :] * s_ms, m_r[:, None] & m_s[None, :], HAS_MASK)
        if ON_BOUNDARY:
            m_vis = m_s[None, :]
            if CAUSAL:
                m_vis = m_vis & (o_s[None, :] <= (S - T + o_t)[:, None])
            b_s = tl.where(m_vis, b_s, float("-inf"))
        b_p = tl.math.exp2(b_s - b_lse[:, None])
        b_dp = _dot(b_do, b_vt, UPCAST)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += _dot(b_ds.to(b_kt.dtype), tl.trans(b_kt), UPCAST)
    return b_dq


@triton.jit
def _moda_bwd_dq_depth_kernel(
    q, k, v, dk, dv, mask, lg, do, lse, delta, dq, ddk, ddv, dg,
    s_qb, s_qh, s_qt, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_dkb, s_dkh, s_dkt, s_dkm, s_dkd,
    s_dvb, s_dvh, s_dvt, s_dvm, s_dvd,
    s_gkb, s_gkh, s_gkt, s_gkm, s_gkd,
    s_mb, s_mh, s_mt, s_ms,
    Hkv, T, S, M, D, G, scale, qk_scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_GATE: tl.constexpr,
    BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DM: tl.constexpr,
    BLOCK_D: tl.constexpr, DEPTH_DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    """dQ (all G heads of a query block) and the block's depth dK / dV, recomputing P from ``lse``; with the gate
    (``lg`` = log2 g [Hq]) also each row's ``sum_m exp2(s_m - lse) (dP_m - D)`` into ``dg`` [B, Hq, T] (fp32, the
    gate's gradient before the sum over batch and tokens; the ungated probability: finite at g = 0; 0 on rows whose
    ``|lse| >= 2**22``, where it overflows).

    ``do``, ``dq`` are contiguous [B, Hq, T, D]; ``lse``, ``delta`` contiguous [B, Hq, T] fp32; ``ddk``, ``ddv``
    [B, Hkv, T, M, D] are written through the strides ``s_gk*`` (both have the same), like the depth entries
    ``dk``, ``dv`` are read through theirs.
    """
    i_t, i_bh = _program_ids(tl.cdiv(T, BLOCK_T))
    i_b, i_hkv = (i_bh // Hkv).to(tl.int64), (i_bh % Hkv).to(tl.int64)
    Hq = Hkv * G
    BLOCK_R: tl.constexpr = BLOCK_T * G_PAD

    o_r = tl.arange(0, BLOCK_R)
    o_t = (i_t * BLOCK_T + o_r // G_PAD).to(tl.int64)
    o_g = o_r % G_PAD
    o_h = i_hkv * G + o_g
    m_r = (o_t < T) & (o_g < G)
    o_d = tl.arange(0, BLOCK_D).to(tl.int64)
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
    p_mask = mask + i_b * s_mb + o_h[:, None] * s_mh + o_t[:, None] * s_mt

    t_first, t_last, s_full, s_hi = _seq_bounds(i_t, T, S, CAUSAL, BLOCK_T, BLOCK_S)
    b_dq = _moda_bwd_dq_seq_inner(
        b_dq, b_q, b_do, b_lse, b_delta, p_k, p_v, p_mask, o_t, m_r, o_d, m_d, 0, s_full, T, S, qk_scale,
        s_ks, s_kd, s_vs, s_vd, s_ms, CAUSAL, HAS_MASK, False, BLOCK_S, UPCAST,
    )
    b_dq = _moda_bwd_dq_seq_inner(
        b_dq, b_q, b_do, b_lse, b_delta, p_k, p_v, p_mask, o_t, m_r, o_d, m_d, s_full, s_hi, T, S, qk_scale,
        s_ks, s_kd, s_vs, s_vd, s_ms, CAUSAL, HAS_MASK, True, BLOCK_S, UPCAST,
    )

    # Depth phase: every row that sees a depth entry of this chunk is in this program, so the
    # depth gradients are complete here and are written once.
    p_dk = dk + i_b * s_dkb + i_hkv * s_dkh
    p_dv = dv + i_b * s_dvb + i_hkv * s_dvh
    p_ddk = ddk + i_b * s_gkb + i_hkv * s_gkh
    p_ddv = ddv + i_b * s_gkb + i_hkv * s_gkh
    j_lo = t_first * M
    j_hi = (t_last + 1) * M
    b_lg = tl.load(lg + o_h, mask=m_r, other=0.0) if HAS_GATE else tl.zeros([BLOCK_R], dtype=tl.float32)
    b_dg = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_resolved = tl.abs(b_lse) < 4194304.0  # a mask-sized lse (padding rows): the ungated score overflows, no dg
    if DEPTH_DOT:
        for j_start in range(j_lo, j_hi, BLOCK_DM):
            o_j = j_start + tl.arange(0, BLOCK_DM)
            m_j = o_j < j_hi
            o_jt = (o_j // M).to(tl.int64)
            o_jm = (o_j % M).to(tl.int64)
            m_jd = m_j[:, None] & m_d[None, :]
            b_dkt = tl.load(p_dk + o_jt[None, :] * s_dkt + o_jm[None, :] * s_dkm + o_d[:, None] * s_dkd,
                            mask=m_d[:, None] & m_j[None, :], other=0.0)
            b_dvt = tl.load(p_dv + o_jt[None, :] * s_dvt + o_jm[None, :] * s_dvm + o_d[:, None] * s_dvd,
                            mask=m_d[:, None] & m_j[None, :], other=0.0)
            b_s = _dot(b_q, b_dkt, UPCAST) * qk_scale
            b_s = tl.where((o_t[:, None] == o_jt[None, :]) & m_j[None, :], b_s, float("-inf"))
            b_p = tl.math.exp2(b_s + b_lg[:, None] - b_lse[:, None])  # [BLOCK_R, BLOCK_DM]
            b_dp = _dot(b_do, b_dvt, UPCAST)
            b_ds = b_p * (b_dp - b_delta[:, None])
            if HAS_GATE:
                b_pt = tl.where(b_resolved[:, None], tl.math.exp2(b_s - b_lse[:, None]), 0.0)
                b_dg += tl.sum(b_pt * (b_dp - b_delta[:, None]), 1)
            b_dq += _dot(b_ds.to(b_dkt.dtype), tl.trans(b_dkt), UPCAST)
            b_ddv = _dot(tl.trans(b_p.to(b_do.dtype)), b_do, UPCAST)
            b_ddk = _dot(tl.trans(b_ds.to(b_q.dtype)), b_q, UPCAST) * scale
            o_g_off = o_jt[:, None] * s_gkt + o_jm[:, None] * s_gkm + o_d[None, :] * s_gkd
            tl.store(p_ddk + o_g_off, b_ddk.to(ddk.dtype.element_ty), mask=m_jd)
            tl.store(p_ddv + o_g_off, b_ddv.to(ddv.dtype.element_ty), mask=m_jd)
    else:
        # Per-entry form (see the forward); the G rows of a token are summed by a reshape.
        p_dk_r = p_dk + o_t[:, None] * s_dkt + o_d[None, :] * s_dkd
        p_dv_r = p_dv + o_t[:, None] * s_dvt + o_d[None, :] * s_dvd
        o_tt = (t_first + tl.arange(0, BLOCK_T)).to(tl.int64)  # the block's tokens
        m_td = (o_tt < T)[:, None] & m_d[None, :]
        p_gk = p_ddk + o_tt[:, None] * s_gkt + o_d[None, :] * s_gkd  # [BLOCK_T, BLOCK_D] at m = 0
        p_gv = p_ddv + o_tt[:, None] * s_gkt + o_d[None, :] * s_gkd
        b_qf = b_q.to(tl.float32)
        b_dof = b_do.to(tl.float32)
        for _ in range(0, M):  # the pointers step one entry at a time: no index x stride product
            b_dkr = tl.load(p_dk_r, mask=m_rd, other=0.0).to(tl.float32)
            b_dvr = tl.load(p_dv_r, mask=m_rd, other=0.0).to(tl.float32)
            p_dk_r += s_dkm
            p_dv_r += s_dvm
            b_sm = tl.where(m_r, tl.sum(b_qf * b_dkr, 1) * qk_scale, float("-inf"))
            b_pm = tl.math.exp2(b_sm + b_lg - b_lse)  # [BLOCK_R]
            b_dpm = tl.sum(b_dof * b_dvr, 1) - b_delta
            b_dsm = b_pm * b_dpm
            if HAS_GATE:
                b_dg += tl.where(b_resolved, tl.math.exp2(b_sm - b_lse), 0.0) * b_dpm
            b_dq += b_dsm[:, None] * b_dkr
            b_ddv = tl.sum(tl.reshape(b_pm[:, None] * b_dof, [BLOCK_T, G_PAD, BLOCK_D]), 1)
            b_ddk = tl.sum(tl.reshape(b_dsm[:, None] * b_qf, [BLOCK_T, G_PAD, BLOCK_D]), 1) * scale
            tl.store(p_gk, b_ddk.to(ddk.dtype.element_ty), mask=m_td)
            tl.store(p_gv, b_ddv.to(ddv.dtype.element_ty), mask=m_td)
            p_gk += s_gkm
            p_gv += s_gkm

    tl.store(dq + o_row[:, None] * D + o_d[None, :], (b_dq * scale).to(dq.dtype.element_ty), mask=m_rd)
    if HAS_GATE:
        tl.store(dg + o_row, b_dg, mask=m_r)


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
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    """Sequence dK / dV of one KV block of one (batch, KV head): loops over the query blocks that can
    see it, all G query heads at once. ``dk``, ``dv`` are contiguous [B, Hkv, S, D]."""
    i_s, i_bh = _program_ids(tl.cdiv(S, BLOCK_S))
    i_b, i_hkv = (i_bh // Hkv).to(tl.int64), (i_bh % Hkv).to(tl.int64)
    Hq = Hkv * G
    BLOCK_R: tl.constexpr = BLOCK_T * G_PAD

    o_s = (i_s * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    m_s = o_s < S
    o_d = tl.arange(0, BLOCK_D).to(tl.int64)
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
        o_t = (t_start + o_rr // G_PAD).to(tl.int64)
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

        b_s = _dot(b_q, tl.trans(b_k), UPCAST) * qk_scale  # [BLOCK_R, BLOCK_S]
        p_mask = mask + i_b * s_mb + o_h[:, None] * s_mh + o_t[:, None] * s_mt + o_s[None, :] * s_ms
        b_s = _hide(b_s, p_mask, m_r[:, None] & m_s[None, :], HAS_MASK)
        m_vis = m_r[:, None] & m_s[None, :]
        if CAUSAL:
            m_vis = m_vis & (o_s[None, :] <= (S - T + o_t)[:, None])
        b_s = tl.where(m_vis, b_s, float("-inf"))
        b_p = tl.math.exp2(b_s - b_lse[:, None])
        b_dv += _dot(tl.trans(b_p.to(b_do.dtype)), b_do, UPCAST)
        b_dp = _dot(b_do, tl.trans(b_v), UPCAST)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dk += _dot(tl.trans(b_ds.to(b_q.dtype)), b_q, UPCAST)

    o_kv = ((i_b * Hkv + i_hkv) * S + o_s)[:, None] * D + o_d[None, :]
    tl.store(dk + o_kv, (b_dk * scale).to(dk.dtype.element_ty), mask=m_sd)
    tl.store(dv + o_kv, b_dv.to(dv.dtype.element_ty), mask=m_sd)




def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _block_sizes(T: int, G: int, D: int, block_t: int | None, block_s: int | None, depth_dot: bool | None,
                 backward: bool = False, ieee: bool = False) -> tuple[dict[str, int | bool], int]:
    """Tile sizes, the depth-phase form and the warps of one launch: ``(constexprs, num_warps)``.

    Rows per program = BLOCK_T * G_PAD (>= 16 for ``tl.dot``): 64 in the forward for d <= 64, else 32; 32 in the
    backward (more live tiles), 16 for d > 128; KV blocks of as many keys (at least 16); 8 warps from d = 128 on and
    in the backward, 4 there for d > 128 (at 8 a thread is capped at 128 registers: 12 B of spills at d = 256,
    sm_80): no bf16 / fp16 kernel spills registers on sm_80 or sm_90 for d = 64, 128, 256 (compiled ahead
    of time, docs/MODA.md). ``ieee`` (IEEE fp32 dots, on the CUDA cores): 16 rows, 4 warps. ``DEPTH_DOT``:
    tensor-core dots over the depth chunk (keeping 1 / BLOCK_T of the products) when BLOCK_T <= 16, per-entry row
    dots otherwise (the FLOP break-even; not a measured tuning).
    """
    g_pad = _next_pow2(G)
    rows = 16 if ieee else (16 if D > 128 else 32) if backward else (64 if D <= 64 else 32)
    if block_t is None:
        # Decoding / short T: no need for more token rows than T (keeping >= 16 rows for tl.dot).
        block_t = max(min(max(rows // g_pad, 1), _next_pow2(T)), max(16 // g_pad, 1))
    elif block_t * g_pad < 16:
        block_t = max(16 // g_pad, 1)
    block_t = _next_pow2(block_t)
    block_s = max(_next_pow2(rows if block_s is None else block_s), 16)
    return {
        "BLOCK_T": block_t, "G_PAD": g_pad, "BLOCK_S": block_s, "BLOCK_DM": block_s, "BLOCK_D": max(_next_pow2(D), 16),
        "DEPTH_DOT": bool(block_t <= 16 if depth_dot is None else depth_dot),
    }, 4 if ieee or backward and D > 128 else 8 if backward or D >= 128 else 4


def launch_grid(num_blocks: int, batch_heads: int) -> tuple[int]:
    """The folded 1-d grid: ``num_blocks * batch_heads`` programs on axis 0 (CUDA allows 2**31 - 1 there)."""
    programs = num_blocks * batch_heads
    if programs > 2**31 - 1:
        raise ValueError(f"the MoDA kernels launch one program per block and (batch, KV head): {programs} "
                         "programs exceed CUDA's 2**31 - 1; split the batch")
    return (programs,)


def _prepare_mask(attention_mask: torch.Tensor | None, shape: tuple[int, int, int, int]) -> torch.Tensor | None:
    """Additive fp32 mask broadcast (by strides, no copy of the broadcast) to ``shape`` [B, Hq, T, S]."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        add = torch.zeros(attention_mask.shape, dtype=torch.float32, device=attention_mask.device)
        add = add.masked_fill(~attention_mask, float("-inf"))
    else:
        add = attention_mask.detach().to(torch.float32)
    return torch.broadcast_to(add, shape)


def _mask_strides(mask: torch.Tensor | None) -> tuple[int, int, int, int]:
    return tuple(mask.stride()) if mask is not None else (0, 0, 0, 0)  # type: ignore[return-value]


def _check(q: torch.Tensor, tensors) -> None:
    if not _HAS_TRITON:
        raise RuntimeError("the MoDA Triton kernels need Triton, which could not be imported")
    if q.dtype not in TRITON_MODA_DTYPES or any(x.dtype != q.dtype for x in tensors):
        raise ValueError(f"the MoDA Triton kernels take q, k, v and the depth entries in one dtype of "
                         f"{TRITON_MODA_DTYPES}; got {[x.dtype for x in (q, *tensors)]} "
                         "(moda_attention casts to one compute dtype and routes float64 to the PyTorch path)")


def _ieee(dtype: torch.dtype) -> bool:
    """IEEE fp32 dots: fp32 inputs where torch's float32 matmul precision forbids TF32 (``"highest"``)."""
    return dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch on the tensors' device (and so on its current stream), not on ``torch.cuda.current_device()``."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _log2_gate(gate: torch.Tensor | None) -> torch.Tensor | None:
    """The depth gate [Hq] as the kernels read it: ``log2 g`` in fp32, contiguous (``-inf`` for a closed head)."""
    return None if gate is None else torch.log2(gate.detach().to(torch.float32)).contiguous()


def triton_moda_forward(q, k, v, depth_k, depth_v, attention_mask, scale, causal, gate=None, *,
                        block_t=None, block_s=None, depth_dot=None):
    """The kernel forward without autograd: ``(out [B, Hq, T, d] in q's dtype, lse2 [B, Hq, T] fp32, renorm)``.

    Inputs as in the module docstring (not validated beyond dtypes: ``moda_attention`` validates them), T >= 1,
    read through their strides, and ``gate`` [Hq] (>= 0, multiplies head h's depth scores) or None. ``lse2`` is the
    row log-sum-exp in base 2 (the kernels' domain; natural: ``lse2 * ln 2``), ``+inf`` for rows with no visible
    key; ``renorm`` [B, Hq, T] fp32 (a float mask only, else None): the factor of the incoming gradient on rows
    whose lse fp32 cannot hold (1 elsewhere).
    ``block_t``, ``block_s``, ``depth_dot`` override the tile rule (tests reach multi-block paths with them).
    """
    _check(q, (k, v, depth_k, depth_v))
    B, Hq, T, D = q.shape
    Hkv, S, M = k.shape[1], k.shape[2], depth_k.shape[3]
    ieee = _ieee(q.dtype)
    blocks, num_warps = _block_sizes(T, Hq // Hkv, D, block_t, block_s, depth_dot, ieee=ieee)
    mask = _prepare_mask(attention_mask, (B, Hq, T, S))
    depth_k, depth_v = depth_k.transpose(1, 2), depth_v.transpose(1, 2)  # token-major -> the kernels' head-major
    o = torch.empty((B, Hq, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    renorm = torch.empty_like(lse) if mask is not None else None
    log2_gate = _log2_gate(gate)
    with _device_guard(q.device):
        # With M = 0 the depth loop is empty: q stands in for the (zero-size) depth tensors, and for no mask / gate.
        _moda_fwd_kernel[launch_grid(triton.cdiv(T, blocks["BLOCK_T"]), B * Hkv)](
            q, k, v, depth_k if M else q, depth_v if M else q, mask if mask is not None else q,
            log2_gate if log2_gate is not None else q, o, lse, renorm if renorm is not None else lse,
            *q.stride(), *k.stride(), *v.stride(), *depth_k.stride(), *depth_v.stride(), *_mask_strides(mask),
            Hkv, T, S, M, D, Hq // Hkv, float(scale) * _LOG2E,
            CAUSAL=bool(causal), HAS_MASK=mask is not None, HAS_GATE=log2_gate is not None,
            UPCAST=ieee or _interpreting() and q.dtype == torch.bfloat16, num_warps=num_warps, **blocks,
        )
    if attention_mask is None or not attention_mask.is_floating_point():
        renorm = None  # no row of a bool mask is unresolved (a hidden key is -inf): nothing to scale
    return o, lse, renorm


def triton_moda_backward(grad_out, q, k, v, depth_k, depth_v, attention_mask, out, lse2, scale, causal, gate=None,
                         *, block_t=None, block_s=None, depth_dot=None):
    """The kernel backward: ``(dq, dk, dv, None, d_depth_k, d_depth_v, d_gate)`` for ``grad_out`` [B, Hq, T, d].

    ``out`` and ``lse2`` (base 2) come from :func:`triton_moda_forward` on the same inputs (``grad_out`` already
    multiplied by its ``renorm``). The depth gradients are token-major [B, T, Hkv, M, d] (contiguous), the others
    have their input's shape; all in q's dtype; ``d_gate`` [Hq] in the gate's dtype (None without a gate). No
    autograd graph is built. The fourth value (the mask's gradient) is always None: the kernels do not
    differentiate the mask.
    """
    _check(q, (k, v, depth_k, depth_v))
    B, Hq, T, D = q.shape
    Hkv, S, M = k.shape[1], k.shape[2], depth_k.shape[3]
    G = Hq // Hkv
    ieee = _ieee(q.dtype)
    blocks, num_warps = _block_sizes(T, G, D, block_t, block_s, depth_dot, backward=True, ieee=ieee)
    mask = _prepare_mask(attention_mask, (B, Hq, T, S))
    depth_k, depth_v = depth_k.transpose(1, 2), depth_v.transpose(1, 2)
    do = grad_out.contiguous()
    delta = (do.float() * out.float()).sum(-1).contiguous()  # [B, Hq, T]
    lse2 = lse2.float().contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ddk = torch.empty((B, T, Hkv, M, D), dtype=q.dtype, device=q.device)
    ddv = torch.empty_like(ddk)
    dk, dv = torch.empty(k.shape, dtype=q.dtype, device=q.device), torch.empty(v.shape, dtype=q.dtype, device=q.device)
    log2_gate = _log2_gate(gate)
    dg = torch.zeros((B, Hq, T), dtype=torch.float32, device=q.device) if gate is not None else None
    flags = dict(CAUSAL=bool(causal), HAS_MASK=mask is not None,
                 UPCAST=ieee or _interpreting() and q.dtype == torch.bfloat16)
    mask_arg = mask if mask is not None else q
    scale = float(scale)
    with _device_guard(q.device):
        _moda_bwd_dq_depth_kernel[launch_grid(triton.cdiv(T, blocks["BLOCK_T"]), B * Hkv)](
            q, k, v, depth_k if M else q, depth_v if M else q, mask_arg, log2_gate if gate is not None else q, do,
            lse2, delta, dq, ddk.transpose(1, 2) if M else dq, ddv.transpose(1, 2) if M else dq,
            dg if gate is not None else delta,
            *q.stride(), *k.stride(), *v.stride(), *depth_k.stride(), *depth_v.stride(),
            *ddk.transpose(1, 2).stride(), *_mask_strides(mask),
            Hkv, T, S, M, D, G, scale, scale * _LOG2E, HAS_GATE=gate is not None, num_warps=num_warps, **flags,
            **blocks,
        )
        kv_blocks = {key: blocks[key] for key in ("BLOCK_T", "G_PAD", "BLOCK_S", "BLOCK_D")}
        _moda_bwd_dkdv_kernel[launch_grid(triton.cdiv(S, blocks["BLOCK_S"]), B * Hkv)](
            q, k, v, mask_arg, do, lse2, delta, dk, dv,
            *q.stride(), *k.stride(), *v.stride(), *_mask_strides(mask),
            Hkv, T, S, D, G, scale, scale * _LOG2E, num_warps=num_warps, **flags, **kv_blocks,
        )
    return dq, dk, dv, None, ddk, ddv, None if gate is None else dg.sum(dim=(0, 2)).to(gate.dtype)
