"""Depth-Weighted Average (DWA), the op behind DenseFormer: ``out = sum_n weights[n] * states[n]``.

Three implementations behind :func:`depth_weighted_average`, one signature:

- ``"reference"``: the paper's loop (Listing 1), obviously correct, autograd does the rest.
- ``"torch"``: a custom autograd Function over the *list* of sources. It never stacks them (the
  paper's package copies every block output into a pre-allocated accumulator and then runs
  ``tensordot``); the backward saves only references to tensors that already exist.
- ``"triton"``: a fused kernel (``dwa_triton.py``) for CUDA tensors, used when Triton imports.

The backend is chosen by the ``backend`` argument, else the ``DEPTHFUSION_BACKEND`` environment
variable, else automatically (Triton for CUDA tensors when available, PyTorch otherwise).

One convention for every op of the package: the public :func:`depth_weighted_average` validates its
inputs and resolves the backend; a model resolves the backend once per forward pass and device
(:func:`resolve_backend`) and calls the unvalidated core :func:`dwa_with_backend`, which routes the
inputs a kernel cannot compute (float64 on the Triton backend) to the PyTorch path. Every path
supports second-order gradients (``create_graph=True``).

This file must stay self-contained (only ``torch`` and same-folder relative imports): it is
copied next to the model code by ``save_pretrained`` for ``trust_remote_code`` loading.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


def triton_unavailable(*_args: object) -> bool:
    """Stands in for the kernel module's availability checks when it does not import: the kernel runs nowhere."""
    return False


try:  # Triton is optional: the model loads and runs without it.
    from .dwa_triton import (
        TRITON_DWA_DTYPES,
        dwa_triton_forward_backward_available,
        dwa_triton_runs_on,
        triton_depth_weighted_average,
    )
except Exception:  # pragma: no cover - depends on the environment
    TRITON_DWA_DTYPES = ()
    triton_depth_weighted_average = None
    dwa_triton_forward_backward_available = dwa_triton_runs_on = triton_unavailable


BACKENDS = ("reference", "torch", "triton")
BACKEND_ENV_VAR = "DEPTHFUSION_BACKEND"
# The dtypes every path computes correctly (states and weights); others are rejected, not rounded.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def resolve_backend(backend: str | None, device: torch.device, config_backend: str | None = None) -> str:
    """Pick the implementation of the op: the one place that decides.

    ========================  =====================================================================
    precedence                where it comes from
    ========================  =====================================================================
    1. ``backend``            the op's ``backend=`` argument
    2. ``$DEPTHFUSION_BACKEND``  the environment variable (an override for a whole process)
    3. ``config_backend``     the model config's ``op_backend`` field (a model passes it)
    4. automatic              Triton for CUDA tensors when the kernel imports, else PyTorch
    ========================  =====================================================================

    A model calls this once per forward pass and device with ``backend=None``; that choice is logged at DEBUG
    (an explicit ``backend`` is not logged: ops called with a resolved backend stay silent).

    Args:
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` (any case) or None.
        device: the device of the op's tensors.
        config_backend: the config's ``op_backend`` (same values), used when neither ``backend`` nor the
            environment variable is set.
    Returns:
        ``"reference"``, ``"torch"`` or ``"triton"``.
    Raises:
        ValueError: for an unknown name, or ``"triton"`` where the kernel cannot run (no Triton, or
            tensors on a device other than CUDA without ``TRITON_INTERPRET=1``).
    """
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV_VAR) or config_backend or "auto"
    if not isinstance(choice, str):
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS} or None; got {choice!r}")
    choice = choice.lower()
    if choice == "auto":
        use_triton = device.type == "cuda" and dwa_triton_forward_backward_available()
        choice = "triton" if use_triton else "torch"
    elif choice not in BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {choice!r}")
    elif choice == "triton" and not dwa_triton_forward_backward_available():
        raise ValueError("backend='triton' was requested but Triton (or its kernel module) is not available")
    elif choice == "triton" and not dwa_triton_runs_on(device):
        raise ValueError(
            f"backend='triton' runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); got device {device}"
        )
    if backend is None:
        logger.debug("%s: backend %r on %s", __name__, choice, device)
    return choice


def _as_list(states: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(states, torch.Tensor):
        if states.dim() < 1:
            raise ValueError("states must have shape [N, *S]; got a 0-d tensor")
        return list(states.unbind(0))
    sources = list(states)
    for n, x in enumerate(sources):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"states must be a tensor [N, *S] or a sequence of tensors; states[{n}] is {type(x)}")
    return sources


def _check_inputs(sources: list[torch.Tensor], weights: torch.Tensor) -> None:
    """Raise a ValueError naming the problem unless the inputs are ones every backend computes correctly."""
    if len(sources) == 0:
        raise ValueError("states must hold at least one tensor (N >= 1)")
    if not isinstance(weights, torch.Tensor):
        raise ValueError(f"weights must be a tensor of shape [N]; got {type(weights)}")
    if weights.dim() != 1 or weights.shape[0] != len(sources):
        raise ValueError(
            f"weights must have shape [N] with N = number of states ({len(sources)}); got {tuple(weights.shape)}"
        )
    first = sources[0]
    for n, x in enumerate(sources):
        if x.shape != first.shape or x.dtype != first.dtype or x.device != first.device:
            raise ValueError(
                f"all states must share shape, dtype and device; states[0] is {tuple(first.shape)} "
                f"{first.dtype} {first.device}, states[{n}] is {tuple(x.shape)} {x.dtype} {x.device}"
            )
    if first.dtype not in DTYPES:
        raise ValueError(f"states must have a floating-point dtype in {DTYPES}; got {first.dtype}")
    if weights.dtype not in DTYPES:
        raise ValueError(f"weights must be a floating-point tensor with a dtype in {DTYPES}; got {weights.dtype}")
    if weights.device != first.device:
        raise ValueError(f"weights must be on the states' device {first.device}; got {weights.device}")


def dwa_reference(sources: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """The paper's loop: ``sum_n weights[n] * sources[n]``.

    Args:
        sources: N tensors of the same shape S.
        weights: [N].
    Returns:
        [*S], in the sources' dtype.
    """
    out = sources[0] * weights[0].to(sources[0].dtype)
    for n in range(1, len(sources)):
        out = out + sources[n] * weights[n].to(sources[n].dtype)
    return out


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# Below this many elements per source, stacking the sources and one matrix-vector product beat N
# per-source kernels (decoding: a few hundred elements, where per-op overhead dominates).
SMALL_NUMEL = 1 << 14


def _scalar_weights(w: torch.Tensor) -> list[float] | torch.Tensor:
    """Python floats on CPU (no sync there; scalar ``alpha`` arguments), else the tensor (indexing it stays async)."""
    return w.tolist() if w.device.type == "cpu" else w


class _DepthWeightedAverage(torch.autograd.Function):
    """``out = sum_n w[n] * x[n]`` over a list of sources, without stacking them.

    Forward: one fused multiply-add per source into a single output buffer (fp32 accumulation for
    half types). Backward: ``grad_x[n] = w[n] * g`` and ``grad_w[n] = <g, x[n]>`` (a dot product,
    no temporary). Only references to the inputs are saved: nothing is stored twice.
    """

    @staticmethod
    def forward(ctx, weights: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        acc_dtype = _accumulation_dtype(sources[0].dtype)
        w = _scalar_weights(weights.detach().to(acc_dtype))
        if acc_dtype == sources[0].dtype:
            out = torch.mul(sources[0], w[0])
        else:
            out = sources[0].to(acc_dtype).mul_(w[0])
        for n in range(1, len(sources)):
            if isinstance(w, list):
                out.add_(sources[n], alpha=w[n])
            else:
                out.addcmul_(sources[n], w[n])
        ctx.save_for_backward(weights, *sources)
        return out.to(sources[0].dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        weights, *sources = ctx.saved_tensors
        grad_weights = None
        if ctx.needs_input_grad[0]:
            g = grad_out.reshape(-1)
            acc_dtype = _accumulation_dtype(g.dtype)
            g_acc = g.to(acc_dtype)
            grad_weights = torch.stack([torch.dot(g_acc, x.reshape(-1).to(acc_dtype)) for x in sources])
            grad_weights = grad_weights.to(weights.dtype)
        # The weight stays in the accumulation dtype (a 0-d operand or a Python scalar does not promote
        # the result), so a half-precision gradient is rounded once, like the fused kernel's. Under
        # create_graph the weights must stay tensors so that double backward reaches them.
        w = weights.to(_accumulation_dtype(grad_out.dtype))
        if not torch.is_grad_enabled():
            w = _scalar_weights(w.detach())
        grad_sources = []
        for n, _x in enumerate(sources):
            if ctx.needs_input_grad[n + 1]:
                grad_sources.append(grad_out * w[n])
            else:
                grad_sources.append(None)
        return (grad_weights, *grad_sources)


def _dwa_small(sources: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """Few elements per source: stack them ([N, M], a negligible copy) and one matrix-vector product.

    Plain autograd ops; half-precision inputs are computed in fp32 and rounded once.
    """
    first = sources[0]
    dtype = first.dtype
    acc_dtype = _accumulation_dtype(dtype)
    stacked = torch.stack(tuple(sources)).view(len(sources), -1)  # (N, M), contiguous
    if acc_dtype != dtype:
        stacked = stacked.to(acc_dtype)
    w = weights if weights.dtype == acc_dtype else weights.to(acc_dtype)
    out = torch.mv(stacked.t(), w)  # (M,)
    if acc_dtype != dtype:
        out = out.to(dtype)
    return out.view(first.shape)


def dwa_torch(sources: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """Efficient PyTorch DWA over a list of sources (see :class:`_DepthWeightedAverage`).

    Sources of fewer than ``SMALL_NUMEL`` elements (cached decoding) take a stacked
    matrix-vector product instead, which costs two kernels instead of N.

    Args:
        sources: N tensors of the same shape S.
        weights: [N].
    Returns:
        [*S], in the sources' dtype.
    """
    if sources[0].numel() <= SMALL_NUMEL:
        return _dwa_small(sources, weights)
    return _DepthWeightedAverage.apply(weights, *sources)


def depth_weighted_average(
    states: torch.Tensor | Sequence[torch.Tensor],
    weights: torch.Tensor,
    backend: str | None = None,
) -> torch.Tensor:
    """Depth-Weighted Average: ``sum_n weights[n] * states[n]``, differentiable in both.

    Args:
        states: a tensor [N, *S] or a sequence of N tensors of shape S (same dtype and device; any
            strides). Dtypes: float16, bfloat16, float32, float64.
        weights: [N] floating-point weights (same dtypes) on the states' device.
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` or None (then
            ``$DEPTHFUSION_BACKEND``, default ``"auto"``). float64 states on ``"triton"`` take the
            PyTorch path (the kernel computes fp32, fp16 and bf16).
    Returns:
        Tensor of shape S and the states' dtype. Half-precision states are accumulated in fp32 by the
        ``"torch"`` and ``"triton"`` backends (the ``"reference"`` loop accumulates in their dtype).
        Gradients of every order (``create_graph=True``) are supported by every backend.
    Raises:
        ValueError: when the shapes, dtypes or devices disagree, a dtype is not a floating-point one
            above (integer and bool tensors are rejected, not truncated), or the backend is unknown or
            cannot run on the states' device.
    """
    sources = _as_list(states)
    _check_inputs(sources, weights)
    return dwa_with_backend(sources, weights, resolve_backend(backend, sources[0].device))


def dwa_with_backend(sources: Sequence[torch.Tensor], weights: torch.Tensor, backend: str) -> torch.Tensor:
    """The core of the op: run a resolved backend on validated inputs, without checking them again.

    Models resolve the backend once per forward pass and device and call this for every DWA step
    (the input checks of :func:`depth_weighted_average` cost as much as the op itself when decoding).
    The one routing decision lives here: the Triton kernel computes fp32, fp16 and bf16; other dtypes
    (float64) take the PyTorch path, which computes them in their own precision.

    Args:
        sources: N tensors of the same shape S, dtype (one of ``DTYPES``) and device.
        weights: [N], on the sources' device.
        backend: ``"reference"``, ``"torch"`` or ``"triton"`` (from :func:`resolve_backend`).
    Returns:
        [*S], in the sources' dtype.
    """
    if backend == "triton" and sources[0].dtype in TRITON_DWA_DTYPES:
        return triton_depth_weighted_average(sources, weights)
    if backend == "reference":
        return dwa_reference(sources, weights)
    return dwa_torch(sources, weights)
