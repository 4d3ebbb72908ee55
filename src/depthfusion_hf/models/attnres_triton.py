"""Fused Triton kernels for Attention Residuals: the formulas of ``attnres.py``'s docstring, per token.

**Launches.** The sources are kernel *arguments*: up to ``SOURCES_PER_LAUNCH`` typed pointers per launch (unused
slots repeat ``x0``; the count ``N_CHUNK`` is a compile-time constant), chained for more; nothing is built on the
host per call, so launches can be captured in a CUDA graph and traced by dynamo, and each pointer keeps its
alignment (vector loads). Launches run under the tensors' device, on its current stream; a program owns
``BLOCK_T`` tokens and whole rows of ``D``; offsets are 64-bit; grids are one-dimensional.

- forward (:func:`attnres_fwd_kernel`): one read of each source row gives ``p_i``, ``r_i`` ([M, N] fp32) and a
  step of an online softmax carried through fp32 buffers between chained launches; the last writes h and the lse.
- backward: :func:`attnres_dots_kernel` writes ``dalpha_i = dh . v_i``; the caller forms ``b``, ``e``;
  :func:`attnres_grads_kernel` writes ``dv_i = alpha_i dh + b_i u + e_i v_i`` and its program's partial ``du``
  (a fixed grid, partials summed in a fixed order: deterministic, no atomics). First order only.

Each source is read in its own dtype (fp32, bf16, fp16), h in the compute dtype, each source's gradient in that
source's dtype; arithmetic is fp32 (elementwise FMAs and row sums: TF32 never applies). Triton is imported in
``try/except`` (this file is copied as remote code); without a GPU the kernels run under ``TRITON_INTERPRET=1``,
set before import. This module never imports the dispatcher (``attnres.py``).
"""

import contextlib

import torch

from .depthfusion_common import TRITON_INTERPRET, import_triton

triton, tl, _TRITON_IMPORT_ERROR = import_triton()

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Largest hidden size: a program holds whole rows (at 16,384 every kernel spills registers, sm_80 and sm_90).
MAX_DIM = 1 << 13
SOURCES_PER_LAUNCH = 8  # pointer arguments per launch (x0..x7)

# Interpreted runs: elements per token tile and the number of backward programs (tests lower them to
# exercise several tiles per program and masked tails).
INTERPRET_TILE_ELEMENTS = 1 << 14
INTERPRET_MAX_PROGRAMS = 4


if triton is not None:

    @triton.jit
    def _pick(i: tl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7):
        """Pointer argument ``i`` of a launch (``i`` is a compile-time constant: no selection at run time)."""
        return (x0 if i == 0 else x1 if i == 1 else x2 if i == 2 else x3 if i == 3 else
                x4 if i == 4 else x5 if i == 5 else x6 if i == 6 else x7)

    @triton.jit
    def attnres_fwd_kernel(
        x0, x1, x2, x3, x4, x5, x6, x7,  # this launch's sources, each [M, D] contiguous, each in its own dtype
        p_u,  # [D] fp32: w * g
        p_p, p_r,  # [M, N] fp32: p_i and r_i (this launch writes columns FIRST_COL .. FIRST_COL + N_CHUNK - 1)
        p_m, p_l, p_acc,  # [M], [M], [M, D] fp32: the online softmax carried between chained launches
        p_h, p_lse,  # [M, D] in the compute dtype, [M] fp32: written by the last launch
        M, D, N, first_col, eps,
        N_CHUNK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One tile of ``BLOCK_T`` tokens: the online softmax over this launch's sources, one read of each."""
        o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        m_t = o_t < M
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        m_td = m_t[:, None] & m_d[None, :]
        o_td = o_t[:, None] * D + o_d[None, :]
        b_u = tl.load(p_u + o_d, mask=m_d, other=0.0)
        if FIRST:
            b_m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
            b_l = tl.zeros([BLOCK_T], dtype=tl.float32)
            b_acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        else:
            b_m = tl.load(p_m + o_t, mask=m_t, other=0.0)
            b_l = tl.load(p_l + o_t, mask=m_t, other=1.0)
            b_acc = tl.load(p_acc + o_td, mask=m_td, other=0.0)
        for i in tl.static_range(N_CHUNK):
            b_x = tl.load(_pick(i, x0, x1, x2, x3, x4, x5, x6, x7) + o_td, mask=m_td, other=0.0).to(tl.float32)
            b_p = tl.sum(b_x * b_u[None, :], axis=1)
            b_r = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
            o_c = o_t * N + (first_col + i)
            tl.store(p_p + o_c, b_p, mask=m_t)
            tl.store(p_r + o_c, b_r, mask=m_t)
            b_m_new = tl.maximum(b_m, b_p * b_r)
            b_scale = tl.exp(b_m - b_m_new)
            b_e = tl.exp(b_p * b_r - b_m_new)
            b_acc = b_acc * b_scale[:, None] + b_e[:, None] * b_x
            b_l = b_l * b_scale + b_e
            b_m = b_m_new
        if LAST:
            tl.store(p_h + o_td, (b_acc / b_l[:, None]).to(p_h.dtype.element_ty), mask=m_td)
            tl.store(p_lse + o_t, b_m + tl.log(b_l), mask=m_t)
        else:
            tl.store(p_m + o_t, b_m, mask=m_t)
            tl.store(p_l + o_t, b_l, mask=m_t)
            tl.store(p_acc + o_td, b_acc, mask=m_td)

    @triton.jit
    def attnres_dots_kernel(
        x0, x1, x2, x3, x4, x5, x6, x7,  # this launch's sources, each [M, D] contiguous
        p_dh,  # [M, D] the gradient of h, in the compute dtype
        p_da,  # [M, N] fp32: dalpha_i = dh . v_i (columns first_col ..)
        M, D, N, first_col,
        N_CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One tile of ``BLOCK_T`` tokens: ``dh . v_i`` for this launch's sources."""
        o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        m_t = o_t < M
        o_d = tl.arange(0, BLOCK_D)
        m_td = m_t[:, None] & (o_d < D)[None, :]
        o_td = o_t[:, None] * D + o_d[None, :]
        b_dh = tl.load(p_dh + o_td, mask=m_td, other=0.0).to(tl.float32)
        for i in tl.static_range(N_CHUNK):
            b_x = tl.load(_pick(i, x0, x1, x2, x3, x4, x5, x6, x7) + o_td, mask=m_td, other=0.0).to(tl.float32)
            tl.store(p_da + (o_t * N + (first_col + i)), tl.sum(b_dh * b_x, axis=1), mask=m_t)

    @triton.jit
    def attnres_grads_kernel(
        x0, x1, x2, x3, x4, x5, x6, x7,  # this launch's sources, each [M, D] contiguous
        g0, g1, g2, g3, g4, g5, g6, g7,  # their gradients (written when HAS_DX), each in its source's layout and dtype
        p_u,  # [D] fp32: w * g
        p_dh,  # [M, D] the gradient of h, in the compute dtype
        p_alpha, p_b, p_e,  # [M, N] fp32: alpha_i, b_i = ds_i r_i, e_i = -b_i p_i r_i^2 / D
        p_du,  # [programs, D] fp32: each program adds its partial du to its row (when HAS_DU)
        M, D, N, first_col, NUM_TILES,
        N_CHUNK: tl.constexpr, HAS_DX: tl.constexpr, HAS_DU: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Token tiles ``pid, pid + programs, ...``: the sources' gradients and this program's partial ``du``."""
        i_p = tl.program_id(0)
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_u = tl.load(p_u + o_d, mask=m_d, other=0.0)
        b_du = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)  # reduced over the tokens once, after the loop
        for i_tile in range(i_p, NUM_TILES, tl.num_programs(0)):
            o_t = tl.arange(0, BLOCK_T).to(tl.int64) + i_tile * BLOCK_T  # i_tile * BLOCK_T < M + BLOCK_T
            m_t = o_t < M
            m_td = m_t[:, None] & m_d[None, :]
            o_td = o_t[:, None] * D + o_d[None, :]
            b_dh = tl.load(p_dh + o_td, mask=m_td, other=0.0).to(tl.float32)
            for i in tl.static_range(N_CHUNK):
                b_x = tl.load(_pick(i, x0, x1, x2, x3, x4, x5, x6, x7) + o_td, mask=m_td, other=0.0).to(tl.float32)
                o_c = o_t * N + (first_col + i)
                b_b = tl.load(p_b + o_c, mask=m_t, other=0.0)
                if HAS_DX:
                    b_a = tl.load(p_alpha + o_c, mask=m_t, other=0.0)
                    b_e = tl.load(p_e + o_c, mask=m_t, other=0.0)
                    b_dx = b_a[:, None] * b_dh + b_b[:, None] * b_u[None, :] + b_e[:, None] * b_x
                    p_g = _pick(i, g0, g1, g2, g3, g4, g5, g6, g7)
                    tl.store(p_g + o_td, b_dx.to(p_g.dtype.element_ty), mask=m_td)
                if HAS_DU:
                    b_du += b_b[:, None] * b_x
        if HAS_DU:
            b_du_row = tl.sum(b_du, axis=0) + tl.load(p_du + i_p * D + o_d, mask=m_d, other=0.0)
            tl.store(p_du + i_p * D + o_d, b_du_row, mask=m_d)


# (elements per token tile, elements of a tile per thread) of each kernel. The forward and the dots kernel: 4,096
# and 16 (8 warps; 16 warps cap a thread at 128 registers, where the forward's unrolled sources spill). The gradients
# kernel keeps four tile-sized operands live (dh, its du accumulator, a source and its gradient): half of that per
# thread (at 16, ptxas spilled 8-48 B in bf16 specialisations on sm_80 and sm_90; found by the AOT harness).
FORWARD_TILE = (4096, 16)
GRADS_TILE = (2048, 8)


def _launch_shape(dim: int, tile: tuple[int, int]) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_D, num_warps)`` for rows of ``dim``: whole rows, about ``tile[0]`` elements per tile
    (``INTERPRET_TILE_ELEMENTS`` interpreted), 4 to 16 warps so that a thread holds about ``tile[1]`` of them (a
    row longer than 16 warps allow gets 16: D = 8,192 in the gradients kernel)."""
    elements, per_thread = tile
    block_d = triton.next_power_of_2(dim)
    if TRITON_INTERPRET:
        return max(1, min(64, INTERPRET_TILE_ELEMENTS // block_d)), block_d, 1
    block_t = max(1, min(64, elements // block_d))
    return block_t, block_d, min(16, max(4, block_t * block_d // (32 * per_thread)))


def _launches(tensors: list[torch.Tensor]):
    """``(first column, SOURCES_PER_LAUNCH pointer arguments, count)`` per chained launch."""
    for first in range(0, len(tensors), SOURCES_PER_LAUNCH):
        part = tensors[first : first + SOURCES_PER_LAUNCH]
        yield first, part + part[:1] * (SOURCES_PER_LAUNCH - len(part)), len(part)


def _on(device: torch.device):
    """The device guard of a launch: Triton launches on the current device's current stream."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check(query: torch.Tensor, sources: list[torch.Tensor], key_norm_weight: torch.Tensor, dtype) -> None:
    if triton is None:
        raise RuntimeError(f"Triton is not available: {_TRITON_IMPORT_ERROR!r}")
    first = sources[0]
    if any(x.shape != first.shape or x.device != first.device for x in sources):
        raise ValueError("the Triton attention_residual needs sources of one shape and device; got "
                         f"{[(tuple(x.shape), str(x.device)) for x in sources]}")
    inputs = {str(x.dtype) for x in (query, key_norm_weight, *sources)}
    if dtype not in SUPPORTED_DTYPES or not inputs <= {str(t) for t in SUPPORTED_DTYPES}:
        raise ValueError(f"the Triton attention_residual computes in fp32: compute dtype and inputs in "
                         f"{SUPPORTED_DTYPES}; got compute dtype {dtype}, inputs {sorted(inputs)} "
                         "(use backend='torch')")
    if first.shape[-1] > MAX_DIM:
        raise ValueError(f"the Triton attention_residual supports D <= {MAX_DIM}; got D={first.shape[-1]}")
    if first.device.type != "cuda" and not TRITON_INTERPRET:
        raise ValueError(f"the Triton attention_residual needs CUDA tensors (or TRITON_INTERPRET=1); "
                         f"got {first.device}")


class _TritonAttentionResidual(torch.autograd.Function):
    """Autograd wrapper of the kernels (inputs: dtype, query, key_norm_weight, eps, *sources; outputs: h, alpha)."""

    @staticmethod
    def forward(ctx, dtype, query, key_norm_weight, eps, *sources):  # noqa: D102
        xs = [x.detach().contiguous() for x in sources]
        shape, n_src, device = xs[0].shape, len(xs), xs[0].device
        dim = shape[-1]
        tokens = xs[0].numel() // dim
        u = (query.detach().float() * key_norm_weight.detach().float()).contiguous()
        h = torch.empty(shape, dtype=dtype, device=device)
        p, r = (torch.empty((tokens, n_src), dtype=torch.float32, device=device) for _ in range(2))
        lse = torch.empty(tokens, dtype=torch.float32, device=device)
        chained = n_src > SOURCES_PER_LAUNCH
        state = (torch.empty_like(lse), torch.empty_like(lse), torch.empty_like(h, dtype=torch.float32)) if chained \
            else (lse,) * 3  # the online softmax carried between chained launches (unused by a single one)
        block_t, block_d, warps = _launch_shape(dim, FORWARD_TILE)
        with _on(device):
            for first, ptrs, count in _launches(xs) if tokens > 0 else ():
                attnres_fwd_kernel[(triton.cdiv(tokens, block_t),)](
                    *ptrs, u, p, r, *state, h, lse, tokens, dim, n_src, first, eps,
                    N_CHUNK=count, FIRST=first == 0, LAST=first + count == n_src,
                    BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps,
                )
        alpha = torch.exp(p * r - lse[:, None]).view(*shape[:-1], n_src)
        ctx.dtype = dtype
        ctx.set_materialize_grads(False)
        # The caller's sources (not contiguous copies) and [M, N] statistics: nothing the size of a source extra.
        ctx.save_for_backward(query, key_norm_weight, p, r, alpha, *sources)
        return h, alpha

    @staticmethod
    def backward(ctx, grad_h, grad_alpha):  # noqa: D102
        if torch.is_grad_enabled():
            raise RuntimeError(
                "attention_residual: the Triton backward is first-order only; for second-order gradients "
                "(create_graph=True) use backend='torch' or backend='reference'"
            )
        query, key_norm_weight, p, r, alpha, *sources = ctx.saved_tensors
        n_src = len(sources)
        need_du = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        need_dx = any(ctx.needs_input_grad[4:])
        if (grad_h is None and grad_alpha is None) or not (need_du or need_dx):
            return (None, None, None, None, *([None] * n_src))
        xs = [x.detach().contiguous() for x in sources]
        shape, dtype, device = xs[0].shape, ctx.dtype, xs[0].device
        dim = shape[-1]
        tokens = xs[0].numel() // dim
        alpha = alpha.reshape(tokens, n_src)
        block_t, block_d, warps = _launch_shape(dim, FORWARD_TILE)
        d_alpha = torch.zeros((tokens, n_src), dtype=torch.float32, device=device)
        dh = torch.zeros(shape, dtype=dtype, device=device) if grad_h is None else grad_h.to(dtype).contiguous()
        with _on(device):
            for first, ptrs, count in _launches(xs) if tokens > 0 and grad_h is not None else ():
                attnres_dots_kernel[(triton.cdiv(tokens, block_t),)](
                    *ptrs, dh, d_alpha, tokens, dim, n_src, first, N_CHUNK=count,
                    BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps)
        if grad_alpha is not None:
            d_alpha += grad_alpha.reshape(tokens, n_src).float()
        b = alpha * (d_alpha - (alpha * d_alpha).sum(dim=1, keepdim=True)) * r
        e = b * p * r.square() / -dim
        dxs = [torch.empty(shape, dtype=x.dtype, device=device) for x in xs] if need_dx else xs
        block_t, block_d, warps = _launch_shape(dim, GRADS_TILE)
        num_tiles = triton.cdiv(tokens, block_t)
        cap = (INTERPRET_MAX_PROGRAMS if TRITON_INTERPRET
               else torch.cuda.get_device_properties(device).multi_processor_count)
        programs = max(1, min(num_tiles, cap if TRITON_INTERPRET else 4 * cap))
        du_partial = torch.zeros((programs, dim), dtype=torch.float32, device=device)
        u = (query.float() * key_norm_weight.float()).contiguous()
        with _on(device):
            for (first, ptrs, count), (_, grads, _) in zip(_launches(xs), _launches(dxs)) if tokens > 0 else ():
                attnres_grads_kernel[(programs,)](
                    *ptrs, *grads, u, dh, alpha, b, e, du_partial, tokens, dim, n_src, first, num_tiles,
                    N_CHUNK=count, HAS_DX=need_dx, HAS_DU=need_du, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps,
                )
        du = du_partial.sum(dim=0)
        d_q = (du * key_norm_weight.float()).to(query.dtype) if ctx.needs_input_grad[1] else None
        d_g = (du * query.float()).to(key_norm_weight.dtype) if ctx.needs_input_grad[2] else None
        d_src = [dxs[i] if need_dx and ctx.needs_input_grad[4 + i] else None for i in range(n_src)]
        return (None, d_q, d_g, None, *d_src)


def triton_attention_residual(
    query: torch.Tensor, sources: list[torch.Tensor], key_norm_weight: torch.Tensor, eps: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Attention Residuals, differentiable (first order): query [D], N sources [B, T, D] of one shape and
    device (CUDA, or CPU under ``TRITON_INTERPRET=1``; dtypes fp32, fp16 or bf16, each read in its own;
    non-contiguous ones are copied), key_norm_weight [D], the compute dtype ``dtype`` -> ``(h [B, T, D] in dtype,
    alpha [B, T, N] fp32)``. Raises ValueError for inputs the kernels cannot compute (float64, D > ``MAX_DIM``,
    a device other than CUDA)."""
    sources = list(sources)
    _check(query, sources, key_norm_weight, dtype)
    return _TritonAttentionResidual.apply(dtype, query, key_norm_weight, float(eps), *sources)
