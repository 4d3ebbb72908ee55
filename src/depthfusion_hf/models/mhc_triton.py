"""Fused Triton kernels for the mHC ops (``mhc_connection.py``, ``mhc_mix.py``), forward and backward, fp32
arithmetic whatever the streams' dtype. N = B T tokens, n streams (``NS``; ``NP``: n padded to a power of two), D the
width, K = n D, R the projection's rows ((2 + n) n, or n for the head).

- :func:`hc_project_kernel`: ``m = rstd * (x fn^T)`` [N, R] and ``rstd`` [N] in one pass over the streams (IEEE
  fp32 ``tl.dot``, the sum of squares alongside).
- :func:`hc_weights_kernel`: pre, post, comb (softmax, the Sinkhorn loop on an [NP, NP] tile per token, padding held
  at 0) and ``collapsed = sum_j pre_j X_j`` (a second pass over the streams), written once in the streams' dtype.
- backward (first order; ``create_graph=True`` raises a RuntimeError naming the other backends):
  :func:`hc_weights_bwd_kernel` (``g_pre = X . g``, the chain rule through the sigmoids, the Sinkhorn loop with each
  step's input recomputed: O(iters^2) tile steps, no stored iterates, and the softmax; ``dp``, the norm's
  coefficient and per-block partial sums for base and scale), :func:`hc_input_bwd_kernel` (``dX = dp fn + c x +
  pre ⊗ g``), :func:`hc_fn_bwd_kernel` (``dfn = dp^T x`` per token split, summed).
- hyper_mix: :func:`mix_fwd_kernel`, :func:`mix_bwd_kernel` (the streams and the gradient read once; d post and
  d comb as per-chunk partial sums).

Offsets are 64-bit; the launch code makes each token's [n, D] contiguous (a copy when not, e.g. the expanded
embedding) and launches on the tensors' CUDA device and current stream. Triton is imported inside ``try/except`` so
that this file (copied next to the model code for ``trust_remote_code``) imports everywhere; without a GPU the
kernels run under ``TRITON_INTERPRET=1``, set before this module is imported.
"""

import contextlib

import torch

from .depthfusion_common import TRITON_INTERPRET, import_triton

triton, tl, _TRITON_IMPORT_ERROR = import_triton()

# The streams' dtypes the kernels read (fp32 arithmetic); the dispatchers send float64 work to PyTorch.
MHC_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The most streams the kernels take (their [NP, NP] tiles and [R, BLOCK_K] projection tiles live in registers: with
# more, the projection kernels spill on sm_80 / sm_90); more go to PyTorch.
TRITON_MAX_STREAMS = 8


if triton is not None:

    @triton.jit
    def hc_project_kernel(p_x, p_fn, p_m, p_rstd, N, K, R, stride_x, norm_eps,
                          BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
        """``m[t] = rstd[t] * (fn x[t])`` [N, R] and ``rstd[t] = 1 / sqrt(mean(x[t]^2) + norm_eps)``."""
        o_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        m_t = o_t < N
        o_r = tl.arange(0, BLOCK_R)
        m_r = o_r < R
        b_acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        b_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < K
            b_x = tl.load(p_x + o_t[:, None] * stride_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0).to(tl.float32)
            b_w = tl.load(p_fn + o_r[None, :].to(tl.int64) * K + o_k[:, None], mask=m_k[:, None] & m_r[None, :],
                          other=0.0).to(tl.float32)  # (BLOCK_K, BLOCK_R) = fn^T
            b_sq += tl.sum(b_x * b_x, axis=1)
            b_acc = tl.dot(b_x, b_w, b_acc, input_precision="ieee")
        b_rstd = tl.rsqrt(b_sq / K + norm_eps)
        tl.store(p_m + o_t[:, None] * R + o_r[None, :], b_acc * b_rstd[:, None], mask=m_t[:, None] & m_r[None, :])
        tl.store(p_rstd + o_t, b_rstd, mask=m_t)

    @triton.jit
    def _gate_logits(p_m, p_base, p_scale, o_t, o_i, mask, R, group: tl.constexpr, NS: tl.constexpr):
        """``scale[group] * m[t, group n + i] + base[group n + i]``: [BLOCK_T, NP] (group 0: pre, 1: post)."""
        b_m = tl.load(p_m + o_t[:, None] * R + group * NS + o_i[None, :], mask=mask, other=0.0)
        b_base = tl.load(p_base + group * NS + o_i, mask=o_i < NS, other=0.0).to(tl.float32)
        return b_m * tl.load(p_scale + group).to(tl.float32) + b_base[None, :]

    @triton.jit
    def _softmax_plus_eps(p_m, p_base, p_scale, o_t, m_t, o_i, R, eps, NS: tl.constexpr):
        """``(A, z, valid)``: A = softmax_row(scale[2] m_comb + base_comb) + eps on [BLOCK_T, NP, NP] (0 in the
        padding), its logits' inputs ``z = m_comb`` and the mask of real entries."""
        o_ij = o_i[:, None] * NS + o_i[None, :]  # (NP, NP): index of comb[i, j] in the row-major n x n block
        valid = (o_i[:, None] < NS) & (o_i[None, :] < NS)
        mask = m_t[:, None, None] & valid[None, :, :]
        b_z = tl.load(p_m + o_t[:, None, None] * R + 2 * NS + o_ij[None, :, :], mask=mask, other=0.0)
        b_base = tl.load(p_base + 2 * NS + o_ij, mask=valid, other=0.0).to(tl.float32)
        b_logit = b_z * tl.load(p_scale + 2).to(tl.float32) + b_base[None, :, :]
        b_logit = tl.where(valid[None, :, :], b_logit, -1e30)  # padded rows stay finite, padded columns vanish
        b_e = tl.exp(b_logit - tl.max(b_logit, axis=2)[:, :, None])
        b_a = tl.where(valid[None, :, :], b_e / tl.sum(b_e, axis=2)[:, :, None] + eps, 0.0)
        return b_a, b_z, valid

    @triton.jit
    def _sinkhorn_step(b_c, step, eps):
        """Step ``step`` of the Sinkhorn loop on [BLOCK_T, NP, NP]: even steps divide by the column sums + eps,
        odd steps by the row sums + eps (the loop: column, then (row, column) x (iters - 1))."""
        if step % 2 == 0:
            b_c = b_c / (tl.sum(b_c, axis=1)[:, None, :] + eps)
        else:
            b_c = b_c / (tl.sum(b_c, axis=2)[:, :, None] + eps)
        return b_c

    @triton.jit
    def _sinkhorn_step_vjp(b_c, b_g, step, eps):
        """The gradient of :func:`_sinkhorn_step`'s input ``b_c`` given its output's gradient ``b_g``:
        ``out = c / s``, ``dc = (g - sum(g out)) / s`` along the normalised axis."""
        if step % 2 == 0:
            b_column = tl.sum(b_c, axis=1)[:, None, :] + eps  # (BLOCK_T, 1, NP)
            b_dc = (b_g - tl.sum(b_g * (b_c / b_column), axis=1)[:, None, :]) / b_column
        else:
            b_row = tl.sum(b_c, axis=2)[:, :, None] + eps  # (BLOCK_T, NP, 1)
            b_dc = (b_g - tl.sum(b_g * (b_c / b_row), axis=2)[:, :, None]) / b_row
        return b_dc

    @triton.jit
    def hc_weights_kernel(p_m, p_base, p_scale, p_x, p_pre, p_post, p_comb, p_y, N, D, stride_x, eps, ITERS,
                          NS: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """pre [N, n] (and post [N, n], comb [N, n, n]) from m, then ``y[t] = sum_j pre[t, j] x[t, j]`` [N, D]."""
        R = NS if HEAD else (2 + NS) * NS
        o_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        m_t = o_t < N
        o_i = tl.arange(0, NP)
        m_ti = m_t[:, None] & (o_i[None, :] < NS)
        b_pre = tl.sigmoid(_gate_logits(p_m, p_base, p_scale, o_t, o_i, m_ti, R, 0, NS)) + eps
        b_pre = tl.where(m_ti, b_pre, 0.0)
        tl.store(p_pre + o_t[:, None] * NS + o_i[None, :], b_pre, mask=m_ti)
        if not HEAD:
            b_post = 2 * tl.sigmoid(_gate_logits(p_m, p_base, p_scale, o_t, o_i, m_ti, R, 1, NS))
            tl.store(p_post + o_t[:, None] * NS + o_i[None, :], b_post, mask=m_ti)
            b_c, _, valid = _softmax_plus_eps(p_m, p_base, p_scale, o_t, m_t, o_i, R, eps, NS)
            for step in range(0, 2 * ITERS - 1):
                b_c = _sinkhorn_step(b_c, step, eps)
            o_ij = o_i[:, None] * NS + o_i[None, :]
            tl.store(p_comb + o_t[:, None, None] * (NS * NS) + o_ij[None, :, :], b_c,
                     mask=m_t[:, None, None] & valid[None, :, :])
        for d0 in range(0, D, BLOCK_D):
            o_d = d0 + tl.arange(0, BLOCK_D)
            m_d = o_d < D
            b_x = tl.load(p_x + o_t[:, None, None] * stride_x + o_i[None, :, None] * D + o_d[None, None, :],
                          mask=m_ti[:, :, None] & m_d[None, None, :], other=0.0).to(tl.float32)
            b_y = tl.sum(b_pre[:, :, None] * b_x, axis=1)
            tl.store(p_y + o_t[:, None] * D + o_d[None, :], b_y.to(p_y.dtype.element_ty),
                     mask=m_t[:, None] & m_d[None, :])

    @triton.jit
    def hc_weights_bwd_kernel(p_m, p_base, p_scale, p_rstd, p_x, p_gy, p_gpost, p_gcomb, p_dp, p_coef,
                              p_dbase, p_dscale, N, D, stride_x, eps, ITERS,
                              NS: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """``dp = rstd * dm`` [N, R] (dm: the gradient of m), ``coef = -(dm . m) rstd^2 / (n D)`` [N], and this
        block's partial sums of d base [R] and d scale [3 or 1] (rows ``pid`` of p_dbase, p_dscale)."""
        R = NS if HEAD else (2 + NS) * NS
        pid = tl.program_id(0)
        o_t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        m_t = o_t < N
        o_i = tl.arange(0, NP)
        m_ti = m_t[:, None] & (o_i[None, :] < NS)
        # g_pre[t, j] = sum_d gy[t, d] x[t, j, d]
        b_gpre = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            o_d = d0 + tl.arange(0, BLOCK_D)
            m_d = o_d < D
            b_x = tl.load(p_x + o_t[:, None, None] * stride_x + o_i[None, :, None] * D + o_d[None, None, :],
                          mask=m_ti[:, :, None] & m_d[None, None, :], other=0.0).to(tl.float32)
            b_gy = tl.load(p_gy + o_t[:, None] * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :],
                           other=0.0).to(tl.float32)
            b_gpre += tl.sum(b_x * b_gy[:, None, :], axis=2)
        b_rstd = tl.load(p_rstd + o_t, mask=m_t, other=0.0)
        # pre = sigmoid(z) + eps, z = scale[0] m + base
        b_sig = tl.sigmoid(_gate_logits(p_m, p_base, p_scale, o_t, o_i, m_ti, R, 0, NS))
        b_dz = tl.where(m_ti, b_gpre * b_sig * (1 - b_sig), 0.0)
        b_mpre = tl.load(p_m + o_t[:, None] * R + o_i[None, :], mask=m_ti, other=0.0)
        b_dm = b_dz * tl.load(p_scale).to(tl.float32)
        tl.store(p_dp + o_t[:, None] * R + o_i[None, :], b_dm * b_rstd[:, None], mask=m_ti)
        tl.store(p_dbase + pid * R + o_i, tl.sum(b_dz, axis=0), mask=o_i < NS)
        tl.store(p_dscale + pid * (1 if HEAD else 3), tl.sum(tl.sum(b_dz * b_mpre, axis=1), axis=0))
        b_dot = tl.sum(b_dm * b_mpre, axis=1)  # sum_r dm_r m_r over this group
        if not HEAD:
            # post = 2 sigmoid(z), z = scale[1] m + base
            b_sig = tl.sigmoid(_gate_logits(p_m, p_base, p_scale, o_t, o_i, m_ti, R, 1, NS))
            b_gpost = tl.load(p_gpost + o_t[:, None] * NS + o_i[None, :], mask=m_ti, other=0.0).to(tl.float32)
            b_dz = tl.where(m_ti, 2 * b_gpost * b_sig * (1 - b_sig), 0.0)
            b_mpost = tl.load(p_m + o_t[:, None] * R + NS + o_i[None, :], mask=m_ti, other=0.0)
            b_dm = b_dz * tl.load(p_scale + 1).to(tl.float32)
            tl.store(p_dp + o_t[:, None] * R + NS + o_i[None, :], b_dm * b_rstd[:, None], mask=m_ti)
            tl.store(p_dbase + pid * R + NS + o_i, tl.sum(b_dz, axis=0), mask=o_i < NS)
            tl.store(p_dscale + pid * 3 + 1, tl.sum(tl.sum(b_dz * b_mpost, axis=1), axis=0))
            b_dot += tl.sum(b_dm * b_mpost, axis=1)
            # comb: back through the Sinkhorn steps (each step's input recomputed from A), then the softmax
            b_a, b_mcomb, valid = _softmax_plus_eps(p_m, p_base, p_scale, o_t, m_t, o_i, R, eps, NS)
            o_ij = o_i[:, None] * NS + o_i[None, :]
            m_tij = m_t[:, None, None] & valid[None, :, :]
            b_g = tl.load(p_gcomb + o_t[:, None, None] * (NS * NS) + o_ij[None, :, :], mask=m_tij,
                          other=0.0).to(tl.float32)
            steps = 2 * ITERS - 1
            for back in range(0, steps):
                step = steps - 1 - back
                b_c = b_a
                for earlier in range(0, step):
                    b_c = _sinkhorn_step(b_c, earlier, eps)
                b_g = tl.where(valid[None, :, :], _sinkhorn_step_vjp(b_c, b_g, step, eps), 0.0)
            b_soft = tl.where(valid[None, :, :], b_a - eps, 0.0)
            b_dz = b_soft * (b_g - tl.sum(b_g * b_soft, axis=2)[:, :, None])
            b_dz = tl.where(m_tij, b_dz, 0.0)
            b_dm = b_dz * tl.load(p_scale + 2).to(tl.float32)
            tl.store(p_dp + o_t[:, None, None] * R + 2 * NS + o_ij[None, :, :], b_dm * b_rstd[:, None, None],
                     mask=m_tij)
            tl.store(p_dbase + pid * R + 2 * NS + o_ij, tl.sum(b_dz, axis=0), mask=valid)
            tl.store(p_dscale + pid * 3 + 2, tl.sum(tl.sum(tl.sum(b_dz * b_mcomb, axis=2), axis=1), axis=0))
            b_dot += tl.sum(tl.sum(b_dm * b_mcomb, axis=2), axis=1)
        tl.store(p_coef + o_t, -b_dot * b_rstd * b_rstd / (NS * D), mask=m_t)

    @triton.jit
    def hc_input_bwd_kernel(p_dp, p_fn, p_coef, p_x, p_pre, p_gy, p_dx, N, D, R, stride_x,
                            NS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
        """``dx[t, k] = sum_r dp[t, r] fn[r, k] + coef[t] x[t, k] + pre[t, k // D] gy[t, k % D]``, k = j D + d
        (the rows r in chunks of ``BLOCK_R``)."""
        K = NS * D
        o_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        m_t = o_t < N
        o_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_dx = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            o_r = r0 + tl.arange(0, BLOCK_R)
            m_r = o_r < R
            b_dp = tl.load(p_dp + o_t[:, None] * R + o_r[None, :], mask=m_t[:, None] & m_r[None, :], other=0.0)
            b_fn = tl.load(p_fn + o_r[:, None].to(tl.int64) * K + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                           other=0.0).to(tl.float32)
            b_dx = tl.dot(b_dp, b_fn, b_dx, input_precision="ieee")  # (BLOCK_T, BLOCK_K)
        b_x = tl.load(p_x + o_t[:, None] * stride_x + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_coef = tl.load(p_coef + o_t, mask=m_t, other=0.0)
        b_pre = tl.load(p_pre + o_t[:, None] * NS + (o_k // D)[None, :], mask=m_tk, other=0.0)
        b_gy = tl.load(p_gy + o_t[:, None] * D + (o_k % D)[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_dx += b_coef[:, None] * b_x + b_pre * b_gy
        tl.store(p_dx + o_t[:, None] * K + o_k[None, :], b_dx.to(p_dx.dtype.element_ty), mask=m_tk)

    @triton.jit
    def hc_fn_bwd_kernel(p_dp, p_x, p_part, N, K, R, stride_x, TOKENS_PER_SPLIT,
                         BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
        """``part[split] = sum_{t in split} dp[t]^T x[t]`` [R, K]: program (k chunk, token split)."""
        o_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        split = tl.program_id(1)
        o_r = tl.arange(0, BLOCK_R)
        m_r = o_r < R
        b_acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        start = split.to(tl.int64) * TOKENS_PER_SPLIT
        for t0 in range(0, TOKENS_PER_SPLIT, BLOCK_T):
            o_t = start + t0 + tl.arange(0, BLOCK_T)
            m_t = (o_t < N) & (o_t < start + TOKENS_PER_SPLIT)
            b_dp = tl.load(p_dp + o_t[:, None] * R + o_r[None, :], mask=m_t[:, None] & m_r[None, :], other=0.0)
            b_x = tl.load(p_x + o_t[:, None] * stride_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0).to(tl.float32)
            b_acc = tl.dot(tl.trans(b_dp), b_x, b_acc, input_precision="ieee")
        tl.store(p_part + split.to(tl.int64) * R * K + o_r[:, None] * K + o_k[None, :], b_acc,
                 mask=m_r[:, None] & m_k[None, :])

    @triton.jit
    def mix_fwd_kernel(p_x, p_f, p_post, p_comb, p_y, N, D, stride_x,
                       NS: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """``y[t, k, d] = post[t, k] f[t, d] + sum_j comb[t, j, k] x[t, j, d]`` for a token block and a D chunk."""
        o_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        m_t = o_t < N
        o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        o_k = tl.arange(0, NP)
        m_tk = m_t[:, None] & (o_k[None, :] < NS)
        m_td = m_t[:, None] & m_d[None, :]
        b_post = tl.load(p_post + o_t[:, None] * NS + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_f = tl.load(p_f + o_t[:, None] * D + o_d[None, :], mask=m_td, other=0.0).to(tl.float32)
        b_y = b_post[:, :, None] * b_f[:, None, :]  # (BLOCK_T, NP, BLOCK_D)
        for j in tl.static_range(NS):
            b_xj = tl.load(p_x + o_t[:, None] * stride_x + j * D + o_d[None, :], mask=m_td, other=0.0).to(tl.float32)
            b_cj = tl.load(p_comb + o_t[:, None] * (NS * NS) + j * NS + o_k[None, :], mask=m_tk,
                           other=0.0).to(tl.float32)
            b_y += b_cj[:, :, None] * b_xj[:, None, :]
        tl.store(p_y + o_t[:, None, None] * (NS * D) + o_k[None, :, None] * D + o_d[None, None, :],
                 b_y.to(p_y.dtype.element_ty), mask=m_tk[:, :, None] & m_d[None, None, :])

    @triton.jit
    def mix_bwd_kernel(p_x, p_f, p_post, p_comb, p_g, p_dx, p_df, p_dpost, p_dcomb, N, D, stride_x,
                       NS: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """For a token block and a D chunk: ``dx[t, j] = sum_k comb[t, j, k] g[t, k]``, ``df[t] = sum_k post[t, k]
        g[t, k]``, and the chunk's partial sums ``dpost[c, t, k] = g[t, k] . f[t]``, ``dcomb[c, t, j, k] = x[t, j] .
        g[t, k]`` (c = the chunk)."""
        o_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        m_t = o_t < N
        chunk = tl.program_id(1)
        o_d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        o_k = tl.arange(0, NP)
        m_tk = m_t[:, None] & (o_k[None, :] < NS)
        m_td = m_t[:, None] & m_d[None, :]
        b_g = tl.load(p_g + o_t[:, None, None] * (NS * D) + o_k[None, :, None] * D + o_d[None, None, :],
                      mask=m_tk[:, :, None] & m_d[None, None, :], other=0.0).to(tl.float32)  # (BLOCK_T, NP, BLOCK_D)
        b_post = tl.load(p_post + o_t[:, None] * NS + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_f = tl.load(p_f + o_t[:, None] * D + o_d[None, :], mask=m_td, other=0.0).to(tl.float32)
        tl.store(p_df + o_t[:, None] * D + o_d[None, :], tl.sum(b_post[:, :, None] * b_g, axis=1).to(
            p_df.dtype.element_ty), mask=m_td)
        o_part = chunk.to(tl.int64) * N + o_t
        tl.store(p_dpost + o_part[:, None] * NS + o_k[None, :], tl.sum(b_g * b_f[:, None, :], axis=2), mask=m_tk)
        for j in tl.static_range(NS):
            b_xj = tl.load(p_x + o_t[:, None] * stride_x + j * D + o_d[None, :], mask=m_td, other=0.0).to(tl.float32)
            b_cj = tl.load(p_comb + o_t[:, None] * (NS * NS) + j * NS + o_k[None, :], mask=m_tk,
                           other=0.0).to(tl.float32)
            tl.store(p_dx + o_t[:, None] * (NS * D) + j * D + o_d[None, :],
                     tl.sum(b_cj[:, :, None] * b_g, axis=1).to(p_dx.dtype.element_ty), mask=m_td)
            tl.store(p_dcomb + o_part[:, None] * (NS * NS) + j * NS + o_k[None, :],
                     tl.sum(b_xj[:, None, :] * b_g, axis=2), mask=m_tk)


# ---------------------------------------------------------------------------------------------------------------
# launch code
# ---------------------------------------------------------------------------------------------------------------


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch on ``device``: Triton uses the current CUDA device and its current stream (a no-op on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` as [N, width] rows whose elements are contiguous (a view when possible, else a copy)."""
    rows = x.reshape(-1, width)
    return rows if rows.stride(1) == 1 or width == 1 else rows.contiguous()


def _projection_blocks(rows: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_K, num_warps)`` of the projection kernels: the rows padded to a power of two (>= 16,
    tl.dot's minimum); for BLOCK_R = 16 (n <= 3) a K chunk of 32 and 2 warps, otherwise a K chunk keeping a
    [BLOCK_R, BLOCK_K] tile at 2048 entries (at most 64) and 4 warps. Larger chunks or more warps at BLOCK_R = 16
    spilled a few bytes on sm_80 / sm_90; with these no specialisation spills up to R = 80 (n = 8), see
    tests/mhc/test_triton_aot.py."""
    block_r = max(16, triton.next_power_of_2(rows))
    if block_r == 16:
        return block_r, 32, 2
    return block_r, max(16, min(64, 2048 // block_r)), 4


def _powers(n: int) -> tuple[int, int]:
    """``(NP, BLOCK_T)`` of the per-token tile kernels: n padded to a power of two, and tokens per program
    (about 256 tile entries per program)."""
    padded = triton.next_power_of_2(n)
    return padded, max(1, min(16, 256 // (padded * padded)))


def _first_order_only(what: str) -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(f"the Triton backward of {what} is first-order: create_graph=True (a gradient of a "
                           "gradient) is computed by backend='torch' or backend='reference'")


class _HyperConnectionTriton(torch.autograd.Function):
    """hyper_connection (``head=False``: returns post, comb, collapsed) or hyper_head (returns collapsed)."""

    @staticmethod
    def forward(ctx, streams, fn, base, scale, iters: int, eps: float, norm_eps: float, head: bool):
        batch, tokens, n, dim = streams.shape
        num, width = batch * tokens, n * dim
        rows = n if head else (2 + n) * n
        x = _rows(streams, width)
        fn_c, base_c, scale_c = fn.contiguous(), base.contiguous(), scale.contiguous()
        device = streams.device
        m = torch.empty(num, rows, device=device, dtype=torch.float32)
        rstd = torch.empty(num, device=device, dtype=torch.float32)
        pre = torch.empty(num, n, device=device, dtype=torch.float32)
        post = torch.empty(num, n, device=device, dtype=torch.float32)
        comb = torch.empty(num, n, n, device=device, dtype=torch.float32)
        y = torch.empty(num, dim, device=device, dtype=streams.dtype)
        block_r, block_k, warps = _projection_blocks(rows)
        padded, block_t = _powers(n)
        with on_device(device):
            hc_project_kernel[(triton.cdiv(num, 16),)](x, fn_c, m, rstd, num, width, rows, x.stride(0), norm_eps,
                                                       BLOCK_T=16, BLOCK_K=block_k, BLOCK_R=block_r, num_warps=warps)
            hc_weights_kernel[(triton.cdiv(num, block_t),)](
                m, base_c, scale_c, x, pre, post, comb, y, num, dim, x.stride(0), eps, iters,
                NS=n, NP=padded, HEAD=head, BLOCK_T=block_t, BLOCK_D=64)
        ctx.settings = (iters, eps, head, tuple(streams.shape))
        ctx.save_for_backward(x, fn_c, base_c, scale_c, m, rstd, pre)
        y = y.view(batch, tokens, dim)
        if head:
            return y
        return post.view(batch, tokens, n), comb.view(batch, tokens, n, n), y

    @staticmethod
    def backward(ctx, *grads):
        _first_order_only("hyper_connection" if not ctx.settings[2] else "hyper_head")
        iters, eps, head, shape = ctx.settings
        x, fn, base, scale, m, rstd, pre = ctx.saved_tensors
        batch, tokens, n, dim = shape
        num, width, rows = batch * tokens, n * dim, m.shape[1]
        device = x.device
        g_y = grads[-1].reshape(num, dim).contiguous()
        g_post = g_comb = g_y  # not read for the head
        if not head:
            g_post, g_comb = grads[0].reshape(num, n).contiguous(), grads[1].reshape(num, n * n).contiguous()
        padded, block_t = _powers(n)
        blocks = triton.cdiv(num, block_t)
        d_p = torch.empty(num, rows, device=device, dtype=torch.float32)
        coef = torch.empty(num, device=device, dtype=torch.float32)
        d_base = torch.zeros(blocks, rows, device=device, dtype=torch.float32)
        d_scale = torch.zeros(blocks, scale.numel(), device=device, dtype=torch.float32)
        block_r, block_k, warps = _projection_blocks(rows)
        d_x = d_fn = None
        with on_device(device):
            hc_weights_bwd_kernel[(blocks,)](m, base, scale, rstd, x, g_y, g_post, g_comb, d_p, coef, d_base,
                                             d_scale, num, dim, x.stride(0), eps, iters, NS=n, NP=padded, HEAD=head,
                                             BLOCK_T=block_t, BLOCK_D=64)
            if ctx.needs_input_grad[0]:
                d_x = torch.empty(num, width, device=device, dtype=x.dtype)
                hc_input_bwd_kernel[(triton.cdiv(num, 16), triton.cdiv(width, 64))](
                    d_p, fn, coef, x, pre, g_y, d_x, num, dim, rows, x.stride(0), NS=n, BLOCK_T=16, BLOCK_K=64,
                    BLOCK_R=min(block_r, 32))
                d_x = d_x.view(shape)
            if ctx.needs_input_grad[1]:
                k_blocks = triton.cdiv(width, block_k)
                splits = max(1, min(triton.cdiv(num, 64), 2 if TRITON_INTERPRET else triton.cdiv(512, k_blocks)))
                per_split = triton.cdiv(triton.cdiv(num, splits), 16) * 16
                part = torch.empty(splits, rows, width, device=device, dtype=torch.float32)
                hc_fn_bwd_kernel[(k_blocks, splits)](d_p, x, part, num, width, rows, x.stride(0), per_split,
                                                     BLOCK_T=16, BLOCK_K=block_k, BLOCK_R=block_r, num_warps=warps)
                d_fn = part.sum(0).to(fn.dtype)
        return d_x, d_fn, d_base.sum(0).to(base.dtype), d_scale.sum(0).to(scale.dtype), None, None, None, None


def triton_hyper_connection(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                            iters: int, eps: float, norm_eps: float, head: bool):
    """The Triton backend of ``hyper_connection`` (``(post, comb, collapsed)``) or ``hyper_head`` (``collapsed``);
    inputs validated and routed by the dispatchers (fp32 weight arithmetic, a kernel dtype, n <= 8)."""
    return _HyperConnectionTriton.apply(streams, fn, base, scale, iters, eps, norm_eps, head)


class _HyperMixTriton(torch.autograd.Function):
    """hyper_mix: ``y = post ⊗ f + comb^T x`` in ``dtype``."""

    @staticmethod
    def forward(ctx, streams, output, post, comb, dtype):
        batch, tokens, n, dim = streams.shape
        num = batch * tokens
        x = _rows(streams, n * dim)
        f, p, c = _rows(output, dim), post.reshape(num, n).contiguous(), comb.reshape(num, n * n).contiguous()
        y = torch.empty(num, n, dim, device=streams.device, dtype=dtype)
        padded, block_t = _powers(n)
        with on_device(streams.device):
            mix_fwd_kernel[(triton.cdiv(num, block_t), triton.cdiv(dim, 64))](
                x, f, p, c, y, num, dim, x.stride(0), NS=n, NP=padded, BLOCK_T=block_t, BLOCK_D=64)
        ctx.dtypes = (streams.dtype, output.dtype, post.dtype, comb.dtype)
        ctx.save_for_backward(x, f, p, c)
        return y.view(batch, tokens, n, dim)

    @staticmethod
    def backward(ctx, grad):
        _first_order_only("hyper_mix")
        x, f, p, c = ctx.saved_tensors
        streams_dtype, output_dtype, post_dtype, comb_dtype = ctx.dtypes
        batch, tokens, n, dim = grad.shape
        num = batch * tokens
        g = grad.reshape(num, n * dim).contiguous()
        padded, block_t = _powers(n)
        chunks = triton.cdiv(dim, 64)
        device = grad.device
        d_x = torch.empty(num, n * dim, device=device, dtype=streams_dtype)
        d_f = torch.empty(num, dim, device=device, dtype=output_dtype)
        d_post = torch.empty(chunks, num, n, device=device, dtype=torch.float32)
        d_comb = torch.empty(chunks, num, n, n, device=device, dtype=torch.float32)
        with on_device(device):
            mix_bwd_kernel[(triton.cdiv(num, block_t), chunks)](
                x, f, p, c, g, d_x, d_f, d_post, d_comb, num, dim, x.stride(0), NS=n, NP=padded, BLOCK_T=block_t,
                BLOCK_D=64)
        return (d_x.view(batch, tokens, n, dim), d_f.view(batch, tokens, dim),
                d_post.sum(0).to(post_dtype).view(batch, tokens, n),
                d_comb.sum(0).to(comb_dtype).view(batch, tokens, n, n), None)


def triton_hyper_mix(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """The Triton backend of ``hyper_mix`` (inputs validated and routed by the dispatcher); the result in ``dtype``."""
    return _HyperMixTriton.apply(streams, output, post, comb, dtype)
