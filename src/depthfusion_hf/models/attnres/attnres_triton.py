"""Fused Triton kernels for Attention Residuals: ``h = sum_i softmax_i(w . RMSNorm_g(v_i)) v_i`` per token.

Layout: the N sources [B, T, D] are passed as a device array of their data pointers (as in
``denseformer/dwa_triton.py``), so one launch reads every source exactly once and nothing is stacked
(a [N, B, T, D] stack would copy all sources every call, and the sources of a model are separate
tensors). Each program owns ``BLOCK_T`` tokens and whole rows of ``D`` (``BLOCK_D = next_pow2(D)``):
a token's logit needs the full row for its norm and its dot product, so rows are never split.

- forward (:func:`attnres_fwd_kernel`): with ``u = w * g`` (fp32), for each source in turn it loads
  the row once, computes ``r_i = rsqrt(mean(v_i^2) + eps)`` and the logit ``s_i = r_i (u . v_i)``,
  and folds ``v_i`` into an online softmax (running max, running sum, fp32 accumulator). It writes h,
  the per-token log-sum-exp ``lse`` and the logits (alpha = exp(logit - lse), [M, N], is formed by
  the caller).
- backward (:func:`attnres_bwd_kernel`): per token ``delta = sum_j alpha_j dalpha_j``, which is
  ``dh . h`` (+ the alpha-gradient term) from the saved output for fp32 sources; for half types a
  rounded h would perturb every ``ds_i`` (percent-level errors in ``dw`` once the softmax is peaked),
  so a first pass over the sources sums ``alpha_j (dh . v_j)`` exactly. Then one pass over the
  sources: recompute ``r_i``, ``s_i``,
  ``alpha_i = exp(s_i - lse)``, ``dalpha_i = dh . v_i``, ``ds_i = alpha_i (dalpha_i - delta)`` and
  write ``dv_i = alpha_i dh + ds_i r_i u - ds_i s_i r_i^2 v_i / D``; ``du += sum ds_i r_i v_i``.
  A fixed grid of programs loops over token tiles and each writes its partial ``du`` [D] to a
  ``[programs, D]`` fp32 buffer, summed in a fixed order afterwards: deterministic, no atomics.
  ``dw = du * g``, ``dg = du * w``.

Traffic per token, in rows of D: forward ``N + 1`` (one read of each source); backward ``2N + 2`` in
fp32 (sources, dh, h in; source gradients out), ``3N + 1`` for half types (the delta pass reads the
sources once more).

Second-order gradients are not implemented here: a backward under ``create_graph=True`` raises
RuntimeError (the dispatcher's torch and reference backends compute them).

Triton is optional: it is imported inside ``try/except`` so that this file (copied next to the model
code for ``trust_remote_code`` loading) imports everywhere. Without a GPU the kernels run under
``TRITON_INTERPRET=1``, which must be set before this module is imported. This module never imports
the dispatcher (``attnres.py``).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch


# Copied from depthfusion_hf.models.denseformer.dwa_triton.import_triton
def import_triton() -> tuple[ModuleType | None, ModuleType | None, Exception | None]:
    """``(triton, triton.language, None)``, or ``(None, None, the import error)`` where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception as exc:  # pragma: no cover - depends on the environment
        return None, None, exc
    return triton, tl, None


triton, tl, _TRITON_IMPORT_ERROR = import_triton()

# Set when this module is imported: Triton reads TRITON_INTERPRET at import time as well.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Largest hidden size: a program holds whole rows (Triton caps a block at 2**20 elements).
MAX_DIM = 1 << 16

# Interpreted runs: elements per token tile and the number of backward programs (tests lower them to
# exercise several tiles per program and masked tails).
INTERPRET_TILE_ELEMENTS = 1 << 14
INTERPRET_MAX_PROGRAMS = 4


# Copied from depthfusion_hf.models.denseformer.dwa_triton.dwa_triton_forward_backward_available with _forward_backward->, dwa_->attnres_  # noqa: E501
def attnres_triton_available() -> bool:
    """True when the fused kernels can run: Triton imports and CUDA is available or ``TRITON_INTERPRET=1``."""
    if triton is None:
        return False
    return _INTERPRET or torch.cuda.is_available()


# Copied from depthfusion_hf.models.denseformer.dwa_triton.dwa_triton_runs_on with _forward_backward->, dwa_->attnres_
def attnres_triton_runs_on(device: torch.device) -> bool:
    """True when the kernels can run on tensors of ``device``: CUDA, or CPU under ``TRITON_INTERPRET=1``."""
    return attnres_triton_available() and (device.type == "cuda" or (_INTERPRET and device.type == "cpu"))


if triton is not None:

    @triton.jit
    def attnres_fwd_kernel(
        p_x_ptrs,  # [N] int64: data pointers of the N contiguous sources, each [M, D]
        p_u,  # [D] fp32: w * g
        p_h,  # [M, D] output, the sources' dtype
        p_lse,  # [M] fp32: log-sum-exp of the logits
        p_logits,  # [M, N] fp32
        M,
        D,
        N,
        eps,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One tile of ``BLOCK_T`` tokens: online softmax over the N sources, one read of each."""
        o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        m_t = o_t < M
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        m_td = m_t[:, None] & m_d[None, :]
        o_td = o_t[:, None] * D + o_d[None, :]
        b_u = tl.load(p_u + o_d, mask=m_d, other=0.0)
        b_m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([BLOCK_T], dtype=tl.float32)
        b_acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for i_n in range(N):
            p_x = tl.load(p_x_ptrs + i_n).to(tl.pointer_type(p_h.dtype.element_ty))
            b_x = tl.load(p_x + o_td, mask=m_td, other=0.0).to(tl.float32)
            b_r = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
            b_s = tl.sum(b_x * b_u[None, :], axis=1) * b_r
            tl.store(p_logits + o_t * N + i_n, b_s, mask=m_t)
            b_m_new = tl.maximum(b_m, b_s)
            b_scale = tl.exp(b_m - b_m_new)
            b_p = tl.exp(b_s - b_m_new)
            b_acc = b_acc * b_scale[:, None] + b_p[:, None] * b_x
            b_l = b_l * b_scale + b_p
            b_m = b_m_new
        tl.store(p_h + o_td, (b_acc / b_l[:, None]).to(p_h.dtype.element_ty), mask=m_td)
        tl.store(p_lse + o_t, b_m + tl.log(b_l), mask=m_t)

    @triton.jit
    def attnres_bwd_kernel(
        p_x_ptrs,  # [N] int64: data pointers of the sources, each [M, D] contiguous
        p_dx_ptrs,  # [N] int64: data pointers of the source gradients (written when HAS_DX)
        p_u,  # [D] fp32: w * g
        p_h,  # [M, D] the forward output (sources' dtype)
        p_dh,  # [M, D] its gradient (sources' dtype)
        p_lse,  # [M] fp32
        p_da,  # [M, N] fp32: gradient of alpha (read when HAS_DA)
        p_ca,  # [M] fp32: sum_j alpha_j * da_j (read when HAS_DA)
        p_du_partial,  # [num_programs, D] fp32 (written when HAS_DU)
        M,
        D,
        N,
        eps,
        NUM_TILES,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_DX: tl.constexpr,
        HAS_DU: tl.constexpr,
        HAS_DA: tl.constexpr,
        DELTA_FROM_H: tl.constexpr,
    ):
        """Token tiles ``pid, pid + programs, ...``: source gradients and this program's partial ``du``."""
        i_p = tl.program_id(0)
        n_p = tl.num_programs(0)
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_u = tl.load(p_u + o_d, mask=m_d, other=0.0)
        b_du = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i_tile in range(i_p, NUM_TILES, n_p):
            o_t = tl.arange(0, BLOCK_T).to(tl.int64) + i_tile * BLOCK_T  # i_tile * BLOCK_T < M + BLOCK_T
            m_t = o_t < M
            m_td = m_t[:, None] & m_d[None, :]
            o_td = o_t[:, None] * D + o_d[None, :]
            b_dh = tl.load(p_dh + o_td, mask=m_td, other=0.0).to(tl.float32)
            b_lse = tl.load(p_lse + o_t, mask=m_t, other=0.0)
            if DELTA_FROM_H:  # fp32: the saved output is the accumulated h
                b_h = tl.load(p_h + o_td, mask=m_td, other=0.0).to(tl.float32)
                b_delta = tl.sum(b_dh * b_h, axis=1)
            else:  # half types: a rounded h would perturb every ds_i, so sum alpha_j (dh . v_j) exactly
                b_delta = tl.zeros([BLOCK_T], dtype=tl.float32)
                for j_n in range(N):
                    p_x = tl.load(p_x_ptrs + j_n).to(tl.pointer_type(p_h.dtype.element_ty))
                    b_x = tl.load(p_x + o_td, mask=m_td, other=0.0).to(tl.float32)
                    b_r = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
                    b_s = tl.sum(b_x * b_u[None, :], axis=1) * b_r
                    b_a = tl.where(m_t, tl.exp(b_s - b_lse), 0.0)
                    b_delta += b_a * tl.sum(b_dh * b_x, axis=1)
            if HAS_DA:
                b_delta += tl.load(p_ca + o_t, mask=m_t, other=0.0)
            for i_n in range(N):
                p_x = tl.load(p_x_ptrs + i_n).to(tl.pointer_type(p_h.dtype.element_ty))
                b_x = tl.load(p_x + o_td, mask=m_td, other=0.0).to(tl.float32)
                b_r = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
                b_s = tl.sum(b_x * b_u[None, :], axis=1) * b_r
                b_a = tl.where(m_t, tl.exp(b_s - b_lse), 0.0)
                b_dalpha = tl.sum(b_dh * b_x, axis=1)
                if HAS_DA:
                    b_dalpha += tl.load(p_da + o_t * N + i_n, mask=m_t, other=0.0)
                b_cu = b_a * (b_dalpha - b_delta) * b_r  # ds_i * r_i
                if HAS_DX:
                    p_dx = tl.load(p_dx_ptrs + i_n).to(tl.pointer_type(p_h.dtype.element_ty))
                    b_cv = b_cu * b_s * b_r / D
                    b_dx = b_a[:, None] * b_dh + b_cu[:, None] * b_u[None, :] - b_cv[:, None] * b_x
                    tl.store(p_dx + o_td, b_dx.to(p_h.dtype.element_ty), mask=m_td)
                if HAS_DU:
                    b_du += tl.sum(b_cu[:, None] * b_x, axis=0)
        if HAS_DU:
            tl.store(p_du_partial + i_p * D + o_d, b_du, mask=m_d)


def _tile(dim: int, elements: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_D)``: whole rows, about ``elements`` per tile."""
    block_d = triton.next_power_of_2(dim)
    return max(1, min(64, elements // block_d)), block_d


def _num_warps(block_t: int, block_d: int) -> int:
    """Warps per program: about 512 tile elements per warp, 4 to 16."""
    if _INTERPRET:
        return 1
    return min(16, max(4, block_t * block_d // 512))


def _num_programs(num_tiles: int, device: torch.device) -> int:
    """Backward grid: a fixed number of programs (deterministic partial sums), at most one per tile."""
    if _INTERPRET:
        cap = INTERPRET_MAX_PROGRAMS
    else:
        cap = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(num_tiles, cap))


def _pointer_array(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[N] int64 tensor of the data pointers of ``tensors`` (contiguous), on ``device``."""
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    return ptrs.to(device, non_blocking=True) if device.type != "cpu" else ptrs


def _check(query: torch.Tensor, sources: list[torch.Tensor], key_norm_weight: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(f"Triton is not available: {_TRITON_IMPORT_ERROR!r}")
    first = sources[0]
    if first.dtype not in SUPPORTED_DTYPES or query.dtype == torch.float64 or key_norm_weight.dtype == torch.float64:
        raise ValueError(
            f"the Triton attention_residual computes in fp32 and supports sources in {SUPPORTED_DTYPES} with "
            f"non-float64 query and key_norm_weight; got {first.dtype}, {query.dtype}, {key_norm_weight.dtype} "
            "(use backend='torch')"
        )
    if first.shape[-1] > MAX_DIM:
        raise ValueError(f"the Triton attention_residual supports D <= {MAX_DIM}; got D={first.shape[-1]}")
    if first.device.type != "cuda" and not _INTERPRET:
        raise ValueError(
            f"the Triton attention_residual needs CUDA tensors (or TRITON_INTERPRET=1); got {first.device}"
        )


class _TritonAttentionResidual(torch.autograd.Function):
    """Autograd wrapper of the fused kernels (inputs: query, key_norm_weight, eps, *sources; outputs: h, alpha)."""

    @staticmethod
    def forward(ctx, query, key_norm_weight, eps, *sources):  # noqa: D102
        first = sources[0]
        batch, seq, dim = first.shape
        n_src = len(sources)
        num_tokens = batch * seq
        device = first.device
        u = (query.detach().float() * key_norm_weight.detach().float()).contiguous()
        h = torch.empty(first.shape, dtype=first.dtype, device=device)
        lse = torch.empty(num_tokens, dtype=torch.float32, device=device)
        logits = torch.empty((num_tokens, n_src), dtype=torch.float32, device=device)
        if num_tokens > 0:
            xs = [x.detach().contiguous() for x in sources]
            block_t, block_d = _tile(dim, INTERPRET_TILE_ELEMENTS if _INTERPRET else 8192)
            attnres_fwd_kernel[(triton.cdiv(num_tokens, block_t),)](
                _pointer_array(xs, device), u, h, lse, logits, num_tokens, dim, n_src, eps,
                BLOCK_T=block_t, BLOCK_D=block_d, num_warps=_num_warps(block_t, block_d),
            )
        alpha = torch.exp(logits - lse[:, None]).view(batch, seq, n_src)
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        # The caller's sources (not contiguous copies) and, in fp32 where the backward reads it, the output h:
        # nothing extra stays alive.
        ctx.save_for_backward(query, key_norm_weight, h if h.dtype == torch.float32 else None, lse, alpha, *sources)
        return h, alpha

    @staticmethod
    def backward(ctx, grad_h, grad_alpha):  # noqa: D102
        query, key_norm_weight, h, lse, alpha, *sources = ctx.saved_tensors
        n_src = len(sources)
        if torch.is_grad_enabled():
            raise RuntimeError(
                "attention_residual: the Triton backward is first-order only; for second-order gradients "
                "(create_graph=True) use backend='torch' or backend='reference'"
            )
        need_du = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_dx = any(ctx.needs_input_grad[3:])
        if (grad_h is None and grad_alpha is None) or not (need_du or need_dx):
            return (None, None, None, *([None] * n_src))
        batch, seq, dim = sources[0].shape
        num_tokens = batch * seq
        dtype, device = sources[0].dtype, sources[0].device
        g32, w32 = key_norm_weight.float(), query.float()
        u = (w32 * g32).contiguous()
        dh = grad_h.contiguous() if grad_h is not None else torch.zeros((batch, seq, dim), dtype=dtype, device=device)
        delta_from_h = h is not None  # fp32: delta = dh . h; half types: a first pass over the sources
        h = h if delta_from_h else dh  # a placeholder of the right dtype, never read
        has_da = grad_alpha is not None
        if has_da:
            da = grad_alpha.float().reshape(num_tokens, n_src).contiguous()
            ca = (alpha.reshape(num_tokens, n_src) * da).sum(dim=1)
        else:
            da = ca = lse  # never read
        dxs = [torch.empty((batch, seq, dim), dtype=dtype, device=device) for _ in range(n_src)] if need_dx else []
        block_t, block_d = _tile(dim, INTERPRET_TILE_ELEMENTS if _INTERPRET else 4096)
        num_tiles = triton.cdiv(num_tokens, block_t)
        programs = _num_programs(num_tiles, device) if num_tokens > 0 else 1
        du_partial = torch.zeros((programs, dim), dtype=torch.float32, device=device)
        if num_tokens > 0:
            xs = [x.detach().contiguous() for x in sources]  # kept alive until the kernel has run
            x_ptrs = _pointer_array(xs, device)
            dx_ptrs = _pointer_array(dxs, device) if need_dx else x_ptrs
            attnres_bwd_kernel[(programs,)](
                x_ptrs, dx_ptrs, u, h, dh, lse, da, ca, du_partial, num_tokens, dim, n_src, ctx.eps, num_tiles,
                BLOCK_T=block_t, BLOCK_D=block_d, HAS_DX=need_dx, HAS_DU=need_du, HAS_DA=has_da,
                DELTA_FROM_H=delta_from_h, num_warps=_num_warps(block_t, block_d),
            )
        du = du_partial.sum(dim=0)
        d_q = (du * g32).to(query.dtype) if ctx.needs_input_grad[0] else None
        d_g = (du * w32).to(key_norm_weight.dtype) if ctx.needs_input_grad[1] else None
        d_src = [dxs[i] if need_dx and ctx.needs_input_grad[3 + i] else None for i in range(n_src)]
        return (d_q, d_g, None, *d_src)


def triton_attention_residual(
    query: torch.Tensor, sources: list[torch.Tensor], key_norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Attention Residuals, differentiable (first order) in query, key_norm_weight and every source.

    Args:
        query: [D] (fp32, fp16 or bf16). sources: N tensors [B, T, D] of one dtype (fp32, fp16 or bf16)
            and device (CUDA, or CPU under ``TRITON_INTERPRET=1``); non-contiguous ones are copied.
        key_norm_weight: [D]. eps: RMSNorm epsilon.
    Returns:
        ``(h, alpha)``: h [B, T, D] in the sources' dtype (fp32 accumulation), alpha [B, T, N] fp32.
    """
    sources = list(sources)
    _check(query, sources, key_norm_weight)
    return _TritonAttentionResidual.apply(query, key_norm_weight, float(eps), *sources)
