"""Depth-Weighted Average (DWA), the op behind DenseFormer: ``out = sum_n weights[n] * states[n]``.

One entry point, :func:`depth_weighted_average`, and three implementations behind it:

=================  ==========================================================================================
backend            implementation
=================  ==========================================================================================
``"reference"``    :func:`dwa_reference`: the paper's loop (Listing 1), differentiated by autograd. The oracle.
``"torch"``        :func:`dwa_torch`: one autograd Function over the *list* of sources (never stacked; it saves
                   only references to the inputs; its backward is differentiable torch ops). Sources of at most
                   ``SMALL_NUMEL`` elements (cached decoding) take one stacked matrix-vector product instead.
``"triton"``       ``dwa_triton.triton_depth_weighted_average``: fused kernels for CUDA tensors (CPU tensors
                   under ``TRITON_INTERPRET=1``); float64 goes to ``"torch"`` (the kernels accumulate in fp32).
=================  ==========================================================================================

Which one runs (:func:`resolve_backend`): the ``backend`` argument, else ``$DEPTHFUSION_BACKEND``, else the
model config's ``op_backend``, else automatic (Triton for CUDA tensors when it imports, else PyTorch).

The compute (and output) dtype, for every backend (:func:`compute_dtype`), is the promoted dtype of the states
and weights, also under autocast: the DWA is the residual stream's sum, which autocast does not lower (a Llama's
``x + f(x)`` stays fp32 under bf16 autocast). Every path reads each source and weight in its own dtype (they
may differ: an fp32 embedding among bf16 block outputs), accumulates in fp32 (float64 for float64) and rounds
once; a source's gradient ``w[n] * g`` is rounded once to that source's dtype, the weights' to theirs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from .depthfusion_common import BACKEND_ENV_VAR, BACKENDS, OP_DTYPES  # noqa: F401 - the first two: the op's API
from .depthfusion_common import resolve_backend as resolve_op_backend

try:  # Triton is optional: the model loads and runs without it.
    from .dwa_triton import TRITON_DWA_DTYPES, triton_depth_weighted_average
except Exception:  # pragma: no cover - depends on the environment
    TRITON_DWA_DTYPES = ()
    triton_depth_weighted_average = None




def resolve_backend(backend: str | None, device: torch.device, config_backend: str | None = None) -> str:
    """The DWA backend: ``"reference"``, ``"torch"`` or ``"triton"``, chosen by the one rule of
    :func:`depthfusion_common.resolve_backend` (the ``backend`` argument, ``$DEPTHFUSION_BACKEND``, the config's
    ``op_backend``, automatic); a ValueError for an unknown name or a Triton backend that cannot run."""
    kernels_imported = triton_depth_weighted_average is not None
    return resolve_op_backend(backend, device, config_backend, kernels_imported=kernels_imported, op=__name__)


def _as_list(states: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(states, torch.Tensor):
        if states.dim() < 1:
            raise ValueError("states must have shape [N, *S]; got a 0-d tensor")
        return list(states.unbind(0))
    return list(states)


def _check_inputs(sources: list[torch.Tensor], weights: torch.Tensor) -> None:
    """Raise a ValueError naming the problem unless every backend computes these inputs correctly (attribute
    reads only, no host synchronisation)."""
    if len(sources) == 0:
        raise ValueError("states must hold at least one tensor (N >= 1)")
    for n, x in enumerate(sources):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"states must be a tensor [N, *S] or a sequence of tensors; states[{n}] is {type(x)}")
        shape, device = sources[0].shape, sources[0].device
        if x.shape != shape or x.device != device:
            raise ValueError(
                f"all states must share shape and device; states[0] is {tuple(shape)} on {device}, "
                f"states[{n}] is {tuple(x.shape)} on {x.device}"
            )
        if x.dtype not in OP_DTYPES:
            raise ValueError(f"states must have a floating-point dtype in {OP_DTYPES}; states[{n}] is {x.dtype}")
    if not isinstance(weights, torch.Tensor):
        raise ValueError(f"weights must be a tensor of shape [N]; got {type(weights)}")
    if weights.dim() != 1 or weights.shape[0] != len(sources):
        raise ValueError(
            f"weights must have shape [N] with N = number of states ({len(sources)}); got {tuple(weights.shape)}"
        )
    if weights.dtype not in OP_DTYPES:
        raise ValueError(f"weights must be a floating-point tensor with a dtype in {OP_DTYPES}; got {weights.dtype}")
    if weights.device != device:
        raise ValueError(f"weights must be on the states' device {device}; got {weights.device}")


def compute_dtype(sources: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.dtype:
    """The op's compute (and output) dtype: the promoted dtype of the states and the weights."""
    dtype = weights.dtype
    for x in sources:
        if x.dtype != dtype:
            dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def autocast_disabled(device_type: str) -> contextlib.AbstractContextManager:
    """A context that turns autocast off for ``device_type`` where it is on (a no-op context elsewhere)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the half types and fp32, float64 for float64: every input converts to it exactly."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dwa_reference(sources: Sequence[torch.Tensor], weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The paper's loop: N sources of shape S, weights [N] -> ``sum_n weights[n] * sources[n]`` [*S] in the
    compute dtype ``dtype``, accumulated in fp32 (float64 for float64)."""
    acc = accumulation_dtype(dtype)
    out = sources[0].to(acc) * weights[0].to(acc)
    for n in range(1, len(sources)):
        out = out + sources[n].to(acc) * weights[n].to(acc)
    return out.to(dtype)


# Up to this many elements per source (decoding), one stacked matrix-vector product beats N per-source kernels.
SMALL_NUMEL = 1 << 14


def _scalar_weights(w: torch.Tensor) -> list[float] | torch.Tensor:
    """Python floats on CPU (no sync there; scalar ``alpha`` arguments), else the tensor (indexing it stays async)."""
    return w.tolist() if w.device.type == "cpu" else w


def _source_gradient(grad_out: torch.Tensor, weight: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``weight * grad_out`` computed in fp32 (float64) and rounded once to a source's ``dtype``."""
    if grad_out.dtype == dtype:
        return grad_out * weight  # a 0-d or Python weight: computed in the op-math dtype, rounded once
    return (grad_out.to(accumulation_dtype(grad_out.dtype)) * weight).to(dtype)


class _DepthWeightedAverage(torch.autograd.Function):
    """``out = sum_n w[n] * x[n]``: one multiply-add per source into one fp32 (float64) buffer, rounded once;
    backward ``grad_x[n] = w[n] * g``, ``grad_w[n] = <g, x[n]>``. Saves only references to the inputs."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, weights: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        acc_dtype = accumulation_dtype(dtype)
        w = _scalar_weights(weights.detach().to(acc_dtype))
        first = sources[0]
        out = torch.mul(first, w[0]) if first.dtype == acc_dtype else first.to(acc_dtype).mul_(w[0])
        for n in range(1, len(sources)):
            if isinstance(w, list):
                out.add_(sources[n], alpha=w[n])
            else:
                out.addcmul_(sources[n], w[n])
        ctx.save_for_backward(weights, *sources)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        weights, *sources = ctx.saved_tensors
        acc_dtype = accumulation_dtype(grad_out.dtype)
        with autocast_disabled(grad_out.device.type):  # a backward called under autocast keeps the op's dtypes
            grad_weights = None
            if ctx.needs_input_grad[1]:
                g = grad_out.reshape(-1).to(acc_dtype)
                grad_weights = torch.stack([torch.dot(g, x.reshape(-1).to(acc_dtype)) for x in sources])
                grad_weights = grad_weights.to(weights.dtype)
            # The weight stays in the accumulation dtype (a 0-d operand or a Python scalar does not promote
            # the result), so a half-precision gradient is rounded once, like the fused kernel's. Under
            # create_graph the weights must stay tensors so that double backward reaches them.
            w = weights.to(acc_dtype)
            if not torch.is_grad_enabled():
                w = _scalar_weights(w.detach())
            grad_sources = [
                _source_gradient(grad_out, w[n], x.dtype) if ctx.needs_input_grad[n + 2] else None
                for n, x in enumerate(sources)
            ]
        return (None, grad_weights, *grad_sources)


def dwa_torch(sources: Sequence[torch.Tensor], weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Vectorised PyTorch DWA: N sources of shape S, weights [N] -> [*S] in ``dtype`` (:class:`_DepthWeightedAverage`).

    At most ``SMALL_NUMEL`` elements per source (cached decoding): the sources stacked in fp32 (float64), [N, M]
    (a negligible copy), and one matrix-vector product of plain autograd ops: two kernels instead of N.
    """
    if sources[0].numel() > SMALL_NUMEL:
        if torch.compiler.is_compiling():  # plain ops, fused by the compiler: a full graph (as vLLM compiles) cannot
            return dwa_reference(sources, weights, dtype)  # trace the Function (its float tolist(), its ctx)
        return _DepthWeightedAverage.apply(dtype, weights, *sources)
    acc_dtype = accumulation_dtype(dtype)
    stacked = torch.stack([x if x.dtype == acc_dtype else x.to(acc_dtype) for x in sources])
    w = weights if weights.dtype == acc_dtype else weights.to(acc_dtype)
    out = torch.mv(stacked.view(len(sources), -1).t(), w)  # (M,)
    return out.to(dtype).view(sources[0].shape)


def depth_weighted_average(
    states: torch.Tensor | Sequence[torch.Tensor],
    weights: torch.Tensor,
    backend: str | None = None,
) -> torch.Tensor:
    """Depth-Weighted Average: ``sum_n weights[n] * states[n]``, differentiable in both (every order).

    The op's only entry point; the module docstring has the dispatch table and the dtype rules.

    Args:
        states: a tensor [N, *S] or a sequence of N tensors of shape S on one device (any strides; dtypes
            float16, bfloat16, float32, float64, which may differ from source to source).
        weights: [N] floating-point weights (same dtypes) on the states' device.
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` or None (then
            ``$DEPTHFUSION_BACKEND``, default ``"auto"``).
    Returns:
        Tensor of shape S in the compute dtype (the promoted dtype of states and weights, also under
        autocast), accumulated in fp32 (float64 for float64).
    Raises:
        ValueError: when the shapes or devices disagree, a dtype is not one of the floating-point ones above
            (integer and bool tensors are rejected, not truncated), or the backend is unknown or cannot run
            on the states' device.
    """
    sources = _as_list(states)
    _check_inputs(sources, weights)
    return dwa_core(resolve_backend(backend, sources[0].device), sources, weights)


def dwa_core(backend: str, sources: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """:func:`depth_weighted_average` past its input check and backend resolution, for inputs known to be valid (a
    model calls this per DWA step with the backend it resolved once per forward): decides the compute dtype and
    runs ``backend`` with autocast off (float64 work asked of Triton runs on torch). Returns [*S]."""
    dtype = compute_dtype(sources, weights)
    with autocast_disabled(sources[0].device.type):  # the dtype is decided: autocast must not recast the products
        if backend == "triton" and dtype in TRITON_DWA_DTYPES:
            return triton_depth_weighted_average(sources, weights, dtype)
        if backend == "reference":
            return dwa_reference(sources, weights, dtype)
        return dwa_torch(sources, weights, dtype)
