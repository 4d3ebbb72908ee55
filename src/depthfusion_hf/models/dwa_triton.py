"""Fused Triton kernels for the Depth-Weighted Average ``y = sum_n w[n] * x[n]``.

The sources are pointer arguments, up to ``SOURCES_PER_LAUNCH`` (16) per launch with the number in use a
run-time argument (one compilation serves every N); more sources take chained launches carrying an fp32 partial
sum. Nothing is built on the host per call (no pointer table: CUDA graphs and dynamo work), and each source is
read in its own dtype with 16-byte vector loads (Triton specialises every pointer on dtype and alignment).

- forward (:func:`dwa_fwd_kernel`): a program accumulates ``w[n] * x_n`` over ``BLOCK`` elements in fp32 and
  writes the result once in the output's dtype (or the fp32 partial for the next launch).
- backward (:func:`dwa_bwd_kernel`): a program reads its block of ``g`` once, writes ``dx_n = w[n] * g``
  (rounded once to ``x_n``'s dtype) and the partial dot products ``<g, x_n>`` into fp32 ``[num_blocks, N]``,
  summed over blocks (deterministically) into ``dw``.

Traffic for N <= 16: forward ``(N + 1) M`` elements, backward ``(2N + 1) M`` (M = prod(S)), the minimum for this
memory-bound op. Offsets are 64-bit; launches run on the tensors' CUDA device and its current stream. Triton is
optional (imported in ``try/except``); without a GPU the kernels run under ``TRITON_INTERPRET=1``, which must be
set before this module is imported.
"""

from __future__ import annotations

import contextlib

import torch

from .depthfusion_common import TRITON_INTERPRET, import_triton, triton_runs_on

triton, tl, _TRITON_IMPORT_ERROR = import_triton()

# The compute dtypes the kernels produce (fp32 accumulation); the dispatcher in dwa.py sends float64 to PyTorch.
TRITON_DWA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Source pointer arguments per launch (the kernels spell them out: Triton has no variadic arguments).
SOURCES_PER_LAUNCH = 16

# Largest block when interpreted (tests lower it to exercise many blocks and masked tails).
INTERPRET_MAX_BLOCK = 1 << 14

# The largest 1-D grid CUDA launches (x dimension).
MAX_GRID = 2**31 - 1


if triton is not None:

    @triton.jit
    def block_offsets(pid, BLOCK: tl.constexpr):
        """The 64-bit flat offsets ``pid * BLOCK + [0, BLOCK)`` of one program's block (no int32 wrap)."""
        return pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)

    @triton.jit
    def _weighted(acc, p_x, p_w, i: tl.constexpr, offsets, mask):
        """``acc + w[i] * x[offsets]`` in fp32 (the source is read in its own dtype)."""
        b_w = tl.load(p_w + i).to(tl.float32)
        return acc + b_w * tl.load(p_x + offsets, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def dwa_fwd_kernel(
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,  # sources, M contiguous elements
        p_w,  # [N] weights of every launch (any float dtype, read as fp32)
        p_acc,  # [M] fp32 partial sum of the previous launches (read when ACCUMULATE)
        p_y,  # [M] output: the result in its dtype, or the fp32 partial for the next launch
        M,
        W_START,  # index of x0's weight
        NUM,  # sources of this launch (x0 .. x{NUM-1}), 1..16; the other arguments are not read
        ACCUMULATE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """``y[o] = acc[o] + sum_{i < NUM} w[W_START + i] * x_i[o]`` for one block of ``BLOCK`` positions."""
        o_m = block_offsets(tl.program_id(0), BLOCK)
        m_m = o_m < M
        if ACCUMULATE:
            b_y = tl.load(p_acc + o_m, mask=m_m, other=0.0).to(tl.float32)
        else:
            b_y = tl.zeros([BLOCK], dtype=tl.float32)
        p_w = p_w + W_START
        p_xs = (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
        b_y = _weighted(b_y, x0, p_w, 0, o_m, m_m)
        for i in tl.static_range(1, 16):  # SOURCES_PER_LAUNCH, unrolled; a source past NUM is not read
            if i < NUM:
                b_y = _weighted(b_y, p_xs[i], p_w, i, o_m, m_m)
        tl.store(p_y + o_m, b_y.to(p_y.dtype.element_ty), mask=m_m)

    @triton.jit
    def _source_grads(b_g, p_x, p_dx, p_w, p_dw, i: tl.constexpr, offsets, mask,
                      HAS_DX: tl.constexpr, HAS_DW: tl.constexpr):
        """``dx_i = w[i] * g`` (rounded once to dx's dtype) and ``dw[i] = <g, x_i>`` over the block."""
        if HAS_DX:
            b_w = tl.load(p_w + i).to(tl.float32)
            tl.store(p_dx + offsets, (b_w * b_g).to(p_dx.dtype.element_ty), mask=mask)
        if HAS_DW:
            b_x = tl.load(p_x + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(p_dw + i, tl.sum(b_g * b_x, axis=0))

    @triton.jit
    def dwa_bwd_kernel(
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,  # sources (read when HAS_DW)
        d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15,  # their gradients (when HAS_DX)
        p_w,  # [N] weights
        p_g,  # [M] gradient of the output
        p_dw_partial,  # [num_blocks, N] fp32: per-block partial dot products (written when HAS_DW)
        M,
        N,
        W_START,
        NUM,
        HAS_DX: tl.constexpr,
        HAS_DW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """For ``i < NUM``: ``d_i = w[W_START + i] * g`` and ``dw_partial[block, W_START + i] = <g, x_i>``."""
        pid = tl.program_id(0)
        o_m = block_offsets(pid, BLOCK)
        m_m = o_m < M
        b_g = tl.load(p_g + o_m, mask=m_m, other=0.0).to(tl.float32)
        p_w = p_w + W_START
        p_dw = p_dw_partial + pid.to(tl.int64) * N + W_START
        p_xs = (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
        p_dxs = (d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15)
        _source_grads(b_g, x0, d0, p_w, p_dw, 0, o_m, m_m, HAS_DX, HAS_DW)
        for i in tl.static_range(1, 16):
            if i < NUM:
                _source_grads(b_g, p_xs[i], p_dxs[i], p_w, p_dw, i, o_m, m_m, HAS_DX, HAS_DW)


def launch_config(numel: int) -> tuple[int, int, int]:
    """``(BLOCK, num_warps, number of blocks)``: 1024 elements per program on GPUs (larger when interpreted);
    a ValueError when the grid would pass CUDA's limit."""
    if TRITON_INTERPRET:
        block, num_warps = max(16, min(triton.next_power_of_2(max(numel, 1)), INTERPRET_MAX_BLOCK)), 1
    else:
        block, num_warps = 1024, 4
    num_blocks = triton.cdiv(numel, block)
    if num_blocks > MAX_GRID:
        raise ValueError(f"the Triton DWA launches at most {MAX_GRID} blocks of {block}; got {numel} elements")
    return block, num_warps, num_blocks


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch on ``device``: Triton uses the current CUDA device and its current stream (a no-op on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def chunks(count: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each launch over ``count`` sources, ``SOURCES_PER_LAUNCH`` at most per launch."""
    return [(start, min(SOURCES_PER_LAUNCH, count - start)) for start in range(0, count, SOURCES_PER_LAUNCH)]


def _padded(tensors: list[torch.Tensor], filler: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` padded to ``SOURCES_PER_LAUNCH`` arguments with ``filler`` (never read by the kernel)."""
    return tensors + [filler] * (SOURCES_PER_LAUNCH - len(tensors))


def dwa_forward(xs: list[torch.Tensor], weights: torch.Tensor, y: torch.Tensor) -> None:
    """``y = sum_n weights[n] * xs[n]`` through :func:`dwa_fwd_kernel` (contiguous ``xs`` of y's numel)."""
    numel = y.numel()
    if numel == 0:
        return
    block, num_warps, num_blocks = launch_config(numel)
    launches = chunks(len(xs))
    # The running sum between launches: fp32 (y itself when y is fp32).
    partial = y if len(launches) == 1 or y.dtype == torch.float32 else torch.empty_like(y, dtype=torch.float32)
    for index, (start, size) in enumerate(launches):
        out = y if index == len(launches) - 1 else partial
        dwa_fwd_kernel[(num_blocks,)](
            *_padded(xs[start : start + size], xs[start]), weights, partial, out, numel, start,
            NUM=size, ACCUMULATE=index > 0, BLOCK=block, num_warps=num_warps,
        )


def dwa_backward(xs: list[torch.Tensor] | None, dxs: list[torch.Tensor] | None, weights: torch.Tensor,
                 g: torch.Tensor) -> torch.Tensor | None:
    """Write ``dxs[n] = weights[n] * g`` (when ``dxs``) and return ``dw`` [N] fp32 (when ``xs``), else None."""
    count = len(xs if xs is not None else dxs)
    numel = g.numel()
    block, num_warps, num_blocks = launch_config(numel)
    dw_partial = torch.zeros((max(num_blocks, 1), count), dtype=torch.float32, device=g.device) if xs else None
    if numel > 0:
        for start, size in chunks(count):
            x_args = _padded(xs[start : start + size], xs[start]) if xs is not None else [g] * SOURCES_PER_LAUNCH
            d_args = _padded(dxs[start : start + size], dxs[start]) if dxs is not None else [g] * SOURCES_PER_LAUNCH
            dwa_bwd_kernel[(num_blocks,)](
                *x_args, *d_args, weights, g, dw_partial if xs is not None else g, numel, count, start,
                NUM=size, HAS_DX=dxs is not None, HAS_DW=xs is not None, BLOCK=block, num_warps=num_warps,
            )
    return dw_partial.sum(dim=0) if xs is not None else None


def _differentiable_grads(needs_input_grad, weights: torch.Tensor, sources, grad_out: torch.Tensor):
    """The backward in PyTorch ops, for ``create_graph=True`` (the kernels record nothing); the kernels'
    arithmetic: fp32 products and sums, one rounding to each gradient's dtype."""
    g = grad_out.float()
    grad_weights = None
    if needs_input_grad[1]:
        grad_weights = torch.stack([(g * x.float()).sum() for x in sources]).to(weights.dtype)
    grad_sources = [
        (g * weights[n].float()).to(x.dtype) if needs_input_grad[n + 2] else None for n, x in enumerate(sources)
    ]
    return (None, grad_weights, *grad_sources)


class _TritonDepthWeightedAverage(torch.autograd.Function):
    """Autograd wrapper of :func:`dwa_fwd_kernel` / :func:`dwa_bwd_kernel` (inputs: dtype, weights, *sources)."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, weights: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        first = sources[0]
        y = torch.empty(first.shape, dtype=dtype, device=first.device)
        with on_device(first.device):
            dwa_forward([x.contiguous() for x in sources], weights.detach().contiguous(), y)
        # Save the caller's tensors (not contiguous copies): nothing extra stays alive until backward.
        ctx.save_for_backward(weights, *sources)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        weights, *sources = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: second-order gradients need a recorded graph
            with torch.autocast(grad_out.device.type, enabled=False):
                return _differentiable_grads(ctx.needs_input_grad, weights, sources, grad_out)
        need_dw, need_dx = ctx.needs_input_grad[1], any(ctx.needs_input_grad[2:])  # autograd calls with one at least
        g = grad_out.contiguous()
        xs = [x.contiguous() for x in sources] if need_dw else None
        dxs = [torch.empty(g.shape, dtype=x.dtype, device=g.device) for x in sources] if need_dx else None
        with on_device(g.device):
            dw = dwa_backward(xs, dxs, weights.detach().contiguous(), g)
        grad_weights = dw.to(weights.dtype) if need_dw else None
        grad_sources = [dxs[n] if need_dx and ctx.needs_input_grad[n + 2] else None for n in range(len(sources))]
        return (None, grad_weights, *grad_sources)


def triton_depth_weighted_average(sources: list[torch.Tensor], weights: torch.Tensor,
                                  dtype: torch.dtype) -> torch.Tensor:
    """Fused DWA ``sum_n weights[n] * sources[n]``, differentiable in both (called by ``dwa.py``'s dispatcher).

    Args:
        sources: N tensors of one shape S on one device (CUDA, or CPU under ``TRITON_INTERPRET=1``), each
            fp32, fp16 or bf16 (they may differ); non-contiguous ones are made contiguous.
        weights: [N] fp32, fp16 or bf16 weights on the same device.
        dtype: the compute (output) dtype, one of ``TRITON_DWA_DTYPES``.
    Returns:
        [*S] in ``dtype``, accumulated in fp32.
    Raises:
        ValueError: for a dtype (float64 included) or device the kernels do not take.
    """
    if triton is None:
        raise RuntimeError(f"Triton is not available: {_TRITON_IMPORT_ERROR!r}")
    for name, t in [("the compute dtype", dtype), ("weights", weights.dtype), *[
            (f"states[{n}]", x.dtype) for n, x in enumerate(sources)]]:
        if t not in TRITON_DWA_DTYPES:
            raise ValueError(f"the Triton DWA supports {TRITON_DWA_DTYPES}; {name} is {t}")
    if not triton_runs_on(sources[0].device) or weights.device != sources[0].device:
        raise ValueError(
            f"the Triton DWA runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), all on one device; "
            f"got states on {sources[0].device}, weights on {weights.device}"
        )
    return _TritonDepthWeightedAverage.apply(dtype, weights, *sources)
