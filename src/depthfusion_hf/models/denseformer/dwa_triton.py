"""Fused Triton kernels for the Depth-Weighted Average ``y = sum_n w[n] * x[n]``.

Both kernels take the N sources through a device array of their data pointers, so a DWA over N
block outputs is **one launch** that reads every source exactly once; nothing is stacked or copied
(the paper's package copies each block output into a pre-allocated accumulator and then runs
``tensordot``).

- forward  (:func:`dwa_fwd_kernel`): each program owns ``BLOCK`` elements of the flattened shape S,
  loops over the N sources, accumulates ``w[n] * x[n]`` in fp32 and writes ``y`` once.
- backward (:func:`dwa_bwd_kernel`): each program loads its block of the output gradient ``g``
  once, writes ``dx[n] = w[n] * g`` for every source and the partial dot products
  ``<g, x[n]>`` of its block into an fp32 ``[N, num_blocks]`` buffer; a deterministic sum over
  blocks gives ``dw`` (no atomics).

Traffic: forward ``(N + 1) * M`` elements, backward ``(2N + 1) * M`` (M = prod(S)) -- the minimum
for the op, which is memory bound.

Triton is optional: it is imported inside ``try/except`` so that this file (copied next to the
model code for ``trust_remote_code`` loading) imports everywhere. Without a GPU the kernels run
under ``TRITON_INTERPRET=1``, which must be set before this module is imported.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch


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

# The dtypes the kernels compute (fp32 accumulation); the dispatcher in dwa.py sends others to PyTorch.
TRITON_DWA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Largest block when interpreted (tests lower it to exercise many blocks and masked tails).
INTERPRET_MAX_BLOCK = 1 << 14


def dwa_triton_forward_backward_available() -> bool:
    """True when the fused kernels can run: Triton imports and CUDA is available or ``TRITON_INTERPRET=1``."""
    if triton is None:
        return False
    return _INTERPRET or torch.cuda.is_available()


def dwa_triton_runs_on(device: torch.device) -> bool:
    """True when the kernels can run on tensors of ``device``: CUDA, or CPU under ``TRITON_INTERPRET=1``."""
    return dwa_triton_forward_backward_available() and (device.type == "cuda" or (_INTERPRET and device.type == "cpu"))


if triton is not None:

    @triton.jit
    def dwa_fwd_kernel(
        p_x_ptrs,  # [N] int64: data pointers of the N contiguous sources, each M elements
        p_w,  # [N] weights (any float dtype, read as fp32)
        p_y,  # [M] output, same dtype as the sources
        N,
        M,
        BLOCK: tl.constexpr,
    ):
        """``y[o] = sum_n w[n] * x_n[o]`` for one block of ``BLOCK`` flattened positions."""
        i_m = tl.program_id(0).to(tl.int64)
        o_m = i_m * BLOCK + tl.arange(0, BLOCK)
        m_m = o_m < M
        b_y = tl.zeros([BLOCK], dtype=tl.float32)
        for i_n in range(N):
            p_x = tl.load(p_x_ptrs + i_n).to(tl.pointer_type(p_y.dtype.element_ty))
            b_w = tl.load(p_w + i_n).to(tl.float32)
            b_x = tl.load(p_x + o_m, mask=m_m, other=0.0).to(tl.float32)
            b_y += b_w * b_x
        tl.store(p_y + o_m, b_y.to(p_y.dtype.element_ty), mask=m_m)

    @triton.jit
    def dwa_bwd_kernel(
        p_x_ptrs,  # [N] int64: data pointers of the sources
        p_dx_ptrs,  # [N] int64: data pointers of the source gradients (written when HAS_DX)
        p_w,  # [N] weights
        p_g,  # [M] gradient of the output, same dtype as the sources
        p_dw_partial,  # [N, NUM_BLOCKS] fp32: per-block partial dot products (written when HAS_DW)
        N,
        M,
        NUM_BLOCKS,
        BLOCK: tl.constexpr,
        HAS_DX: tl.constexpr,
        HAS_DW: tl.constexpr,
    ):
        """``dx_n = w[n] * g`` and ``dw_partial[n, block] = <g, x_n>`` over one block of positions."""
        i_b = tl.program_id(0)
        o_m = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m_m = o_m < M
        b_g = tl.load(p_g + o_m, mask=m_m, other=0.0).to(tl.float32)
        for i_n in range(N):
            if HAS_DX:
                p_dx = tl.load(p_dx_ptrs + i_n).to(tl.pointer_type(p_g.dtype.element_ty))
                b_w = tl.load(p_w + i_n).to(tl.float32)
                tl.store(p_dx + o_m, (b_w * b_g).to(p_g.dtype.element_ty), mask=m_m)
            if HAS_DW:
                p_x = tl.load(p_x_ptrs + i_n).to(tl.pointer_type(p_g.dtype.element_ty))
                b_x = tl.load(p_x + o_m, mask=m_m, other=0.0).to(tl.float32)
                tl.store(p_dw_partial + i_n * NUM_BLOCKS + i_b, tl.sum(b_g * b_x, axis=0))


def _launch_config(numel: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)``: large blocks when interpreted (fewer simulated programs), 1024 on GPUs."""
    if _INTERPRET:
        return max(16, min(triton.next_power_of_2(max(numel, 1)), INTERPRET_MAX_BLOCK)), 1
    return 1024, 4


def _pointer_array(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[N] int64 tensor of the data pointers of ``tensors`` (contiguous), on ``device``."""
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    return ptrs.to(device, non_blocking=True) if device.type != "cpu" else ptrs


def _check(sources: list[torch.Tensor], weights: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(f"Triton is not available: {_TRITON_IMPORT_ERROR!r}")
    if sources[0].dtype not in TRITON_DWA_DTYPES:
        raise ValueError(f"the Triton DWA supports {TRITON_DWA_DTYPES}; got {sources[0].dtype}")
    if weights.device != sources[0].device:
        raise ValueError(f"weights are on {weights.device} but the states on {sources[0].device}")
    if not dwa_triton_runs_on(sources[0].device):
        raise ValueError(
            f"the Triton DWA runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); got {sources[0].device}"
        )


def _differentiable_grads(needs_input_grad, weights: torch.Tensor, sources, grad_out: torch.Tensor):
    """The backward from PyTorch ops, so that ``create_graph=True`` records it (the kernels record nothing).

    Same arithmetic as the kernels: fp32 products and sums, one rounding to the output dtype.
    """
    g = grad_out.float()
    grad_weights = None
    if needs_input_grad[0]:
        grad_weights = torch.stack([(g * x.float()).sum() for x in sources]).to(weights.dtype)
    grad_sources = [
        (g * weights[n].float()).to(grad_out.dtype) if needs_input_grad[n + 1] else None for n in range(len(sources))
    ]
    return (grad_weights, *grad_sources)


class _TritonDepthWeightedAverage(torch.autograd.Function):
    """Autograd wrapper of :func:`dwa_fwd_kernel` / :func:`dwa_bwd_kernel` (inputs: weights, *sources)."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        first = sources[0]
        xs = [x.contiguous() for x in sources]
        w = weights.detach().contiguous()
        y = torch.empty(first.shape, dtype=first.dtype, device=first.device)
        numel = y.numel()
        if numel > 0:
            block, num_warps = _launch_config(numel)
            grid = (triton.cdiv(numel, block),)
            dwa_fwd_kernel[grid](
                _pointer_array(xs, first.device), w, y, len(xs), numel, BLOCK=block, num_warps=num_warps
            )
        # Save the caller's tensors (not contiguous copies): nothing extra stays alive until backward.
        ctx.save_for_backward(weights, *sources)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        weights, *sources = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: second-order gradients need a recorded graph
            return _differentiable_grads(ctx.needs_input_grad, weights, sources, grad_out)
        need_dw = ctx.needs_input_grad[0]
        need_dx = any(ctx.needs_input_grad[1:])
        n_src = len(sources)
        g = grad_out.contiguous()
        numel = g.numel()
        device = g.device
        xs = [x.contiguous() for x in sources] if need_dw else []
        dxs = [torch.empty_like(g) for _ in range(n_src)] if need_dx else []
        block, num_warps = _launch_config(numel)
        num_blocks = triton.cdiv(numel, block) if numel > 0 else 0
        dw_partial = torch.zeros((n_src, max(num_blocks, 1)), dtype=torch.float32, device=device)
        if numel > 0 and (need_dw or need_dx):
            # Unused pointer arrays still need a valid tensor argument; the kernel never reads them.
            x_ptrs = _pointer_array(xs, device) if need_dw else dw_partial
            dx_ptrs = _pointer_array(dxs, device) if need_dx else dw_partial
            dwa_bwd_kernel[(num_blocks,)](
                x_ptrs,
                dx_ptrs,
                weights.detach().contiguous(),
                g,
                dw_partial,
                n_src,
                numel,
                num_blocks,
                BLOCK=block,
                HAS_DX=need_dx,
                HAS_DW=need_dw,
                num_warps=num_warps,
            )
        grad_weights = dw_partial.sum(dim=1).to(weights.dtype) if need_dw else None
        grad_sources = [
            (dxs[n].view(sources[n].shape) if ctx.needs_input_grad[n + 1] else None) for n in range(n_src)
        ] if need_dx else [None] * n_src
        return (grad_weights, *grad_sources)


def triton_depth_weighted_average(sources: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """Fused DWA: ``sum_n weights[n] * sources[n]`` in one kernel, differentiable in both.

    Args:
        sources: N tensors of one shape S, dtype (fp32, fp16 or bf16) and device (CUDA, or CPU under
            ``TRITON_INTERPRET=1``); non-contiguous ones are made contiguous.
        weights: [N] floating-point weights on the same device.
    Returns:
        [*S] in the sources' dtype, accumulated in fp32. Second-order gradients (``create_graph=True``)
        are computed by PyTorch ops with the same arithmetic.
    Raises:
        ValueError: for another dtype (float64 goes through ``depth_weighted_average``, which routes it to
            the PyTorch path) or device.
    """
    sources = list(sources)
    _check(sources, weights)
    return _TritonDepthWeightedAverage.apply(weights, *sources)
