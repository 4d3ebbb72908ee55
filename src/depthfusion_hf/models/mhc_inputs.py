"""Input checks and the dtype rule shared by the mHC ops (``mhc_connection.py``, ``mhc_mix.py``).

``save_pretrained`` copies it next to the model code (torch and same-folder imports only).
"""

import contextlib
import math

import torch

from .depthfusion_common import OP_DTYPES


def weight_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype of the mHC weight arithmetic: float64 when any input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, skipping the dispatch when it already has that dtype (the ops call it per sub-layer)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context that turns autocast off for ``device_type`` where it is on (a no-op context elsewhere)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def check_tensor(name: str, value, shape: tuple[int, ...] | None, device: torch.device | None, layout: str) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a floating tensor of ``shape`` (None: any shape) on
    ``device`` (None: any device)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a tensor {layout}; got {type(value).__name__}")
    if value.dtype not in OP_DTYPES:
        raise ValueError(f"{name} must have a floating-point dtype in {OP_DTYPES}; got {value.dtype}")
    if shape is not None and tuple(value.shape) != shape:
        raise ValueError(f"{name} must have shape {layout} = {shape}; got {tuple(value.shape)}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on the streams' device {device}; got {value.device}")


def check_positive(name: str, value) -> None:
    """Raise a ValueError naming ``name`` unless it is a finite real number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0; got {value!r}")


def check_streams(streams) -> tuple[int, int, int, int]:
    """Raise a ValueError unless ``streams`` is a floating [B, T, n, D] tensor with n, D >= 1; returns its shape."""
    check_tensor("streams", streams, None, None, "[B, T, n, D]")
    if streams.dim() != 4 or streams.shape[2] < 1 or streams.shape[3] < 1:
        raise ValueError(f"streams must have shape [B, T, n, D] with n, D >= 1; got {tuple(streams.shape)}")
    return tuple(streams.shape)
