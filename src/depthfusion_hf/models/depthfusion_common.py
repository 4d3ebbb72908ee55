"""What every family needs, once: number validators, the decoder input checks and preamble, the op backend choice,
the optional Triton import and the checked loading of a saved folder (the causal families' config base is
``configuration_decoder.py``).

Every family module imports it with a single-dot import (``from .depthfusion_common import ...``), so
``save_pretrained`` (transformers' ``custom_object_save``) copies it into each remote-code folder next to the family's
files: it needs only torch and transformers (Triton is optional), like the rest of a saved folder.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers.cache_utils import Cache, DynamicCache

from .backbones import layer_inputs

logger = logging.getLogger(__name__)

BACKENDS = ("reference", "torch", "triton")
OP_BACKENDS = ("auto", *BACKENDS)
BACKEND_ENV_VAR = "DEPTHFUSION_BACKEND"
# Read once, when the kernels are imported: Triton reads TRITON_INTERPRET at import time as well.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The tensor dtypes every op path computes correctly; others are rejected, not rounded.
OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_positive_int(name: str, value, upper: int | None = None, upper_name: str | None = None) -> None:
    """Raise a ValueError naming ``name`` unless ``1 <= value (<= upper)``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper is not None and value > upper):
        allowed = f"an integer in [1, {upper}] ({upper_name})" if upper is not None else "an integer >= 1"
        raise ValueError(f"`{name}` must be {allowed}; got {value!r}")


def check_real(name: str, value, lower: float | None, upper: float | None = None, closed_lower: bool = False) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a finite real number above ``lower`` (or equal to it
    when ``closed_lower``) and below ``upper``; a ``None`` bound is not checked."""
    valid = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if valid and lower is not None:
        valid = value >= lower if closed_lower else value > lower
    if valid and upper is not None:
        valid = value < upper
    if not valid:
        bounds = [f"{'>=' if closed_lower else '>'} {lower}"] if lower is not None else []
        bounds += [f"< {upper}"] if upper is not None else []
        raise ValueError(f"`{name}` must be a finite number {' and '.join(bounds)}".rstrip() + f"; got {value!r}")


def safetensors_problems(folder: Path) -> list[str]:
    """``"<file>: <error>"`` for every ``*.safetensors`` file of ``folder`` whose header safetensors refuses (a
    truncated or overwritten file)."""
    problems = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt"):
                pass
        except (SafetensorError, OSError) as error:
            problems.append(f"{path}: {error}")
    return problems


class CheckedModelMixin:
    """Put before the transformers base class of a family's PreTrainedModel: the config is checked when a model is
    built, and a damaged weights file in a loaded folder is named (safetensors' own error does not name it)."""

    def __init__(self, config, *inputs, **kwargs):
        config.check_fields()  # a field changed after construction gets the construction error
        super().__init__(config, *inputs, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' ``from_pretrained``; an unreadable ``*.safetensors`` file raises an OSError naming it."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        except SafetensorError as error:
            folder = Path(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
            problems = safetensors_problems(folder) if folder.is_dir() else []
            if not problems:
                raise
            raise OSError(f"cannot load the weights of {folder}: damaged (truncated or overwritten) safetensors "
                          f"file(s): {'; '.join(problems)}. Save or download the folder again.") from error


def check_token_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, vocab_size: int) -> None:
    """Reject decoder inputs the model cannot compute with a ValueError that names the problem.

    Args:
        input_ids: [B, T] integer token ids, or None when ``inputs_embeds`` is given.
        inputs_embeds: [B, T, D] embeddings, or None when ``input_ids`` is given.
        vocab_size: ids must lie in ``[0, vocab_size)``.
    Raises:
        ValueError: unless exactly one of the two is given, it has the shape above with at least one
            token, and (for ids) an integer dtype and every id in range (not checked on the meta device,
            which holds no values). On CUDA and under ``torch.compile`` an id out of range fails as an op
            instead: a RuntimeError (on CUDA a device-side assertion, raised at the next sync).
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    name, tensor, rank = ("input_ids", input_ids, 2) if input_ids is not None else ("inputs_embeds", inputs_embeds, 3)
    if tensor.dim() != rank:
        layout = "[batch, tokens]" if rank == 2 else "[batch, tokens, hidden]"
        raise ValueError(f"{name} must have shape {layout}; got shape {tuple(tensor.shape)}")
    if tensor.numel() == 0:
        raise ValueError(f"{name} must have at least one token; got shape {tuple(tensor.shape)}")
    if input_ids is None:
        return
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor; got {input_ids.dtype}")
    if input_ids.device.type == "meta":
        return  # no values to check: the meta device only sizes and plans models
    out_of_range = ((input_ids < 0) | (input_ids >= vocab_size)).any()
    if input_ids.device.type == "cuda" or torch.compiler.is_compiling():
        # No host sync per forward (it would stall every training and decoding step, and break a compiled graph):
        # the check runs as an op and fails (on CUDA: at the next synchronising call) with this message.
        torch._assert_async(~out_of_range, f"input_ids must lie in [0, vocab_size={vocab_size})")
    elif bool(out_of_range):
        raise ValueError(
            f"input_ids must lie in [0, vocab_size={vocab_size}); got min {int(input_ids.min())}, "
            f"max {int(input_ids.max())}"
        )


def prepare_decoder_inputs(
    model: nn.Module,
    input_ids: torch.LongTensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.LongTensor | None,
    cache: Cache | None,
    inputs_embeds: torch.Tensor | None,
    use_cache: bool | None,
) -> tuple[torch.Tensor, torch.LongTensor, Cache | None, list[dict]]:
    """The decoder preamble shared by the family models, as the backbone's own model forward makes it: check and
    embed the tokens, make the cache, positions, and each layer's mask and rotary embeddings.

    Args:
        model: the decoder (with ``config``, ``embed_tokens`` and ``rotary_emb``).
        input_ids: [B, T] token ids (or ``inputs_embeds`` [B, T, D]).
        attention_mask: [B, S] padding mask over cached + new positions (1 = keep).
        position_ids: [B, T]; by default continue from the cache length.
        cache: a transformers ``Cache``; a ``DynamicCache`` is made when none is given and ``use_cache``.
    Returns:
        (inputs_embeds [B, T, D], position_ids [B or 1, T], cache, per layer ``{"attention_mask": its mask,
        "position_embeddings": its rotary (cos, sin), each [B or 1, T, head_dim]}``; :func:`backbones.layer_inputs`).
    """
    check_token_inputs(input_ids, inputs_embeds, model.config.vocab_size)
    if inputs_embeds is None:
        inputs_embeds = model.embed_tokens(input_ids)  # (B, T, D)
    if use_cache and cache is None:
        cache = DynamicCache(config=model.config)
    if position_ids is None:
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
        position_ids = position_ids.unsqueeze(0)
    return inputs_embeds, position_ids, cache, layer_inputs(model, inputs_embeds, attention_mask, cache, position_ids)


def import_triton() -> tuple[ModuleType | None, ModuleType | None, Exception | None]:
    """``(triton, triton.language, None)``, or ``(None, None, the import error)`` where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception as exc:  # pragma: no cover - depends on the environment
        return None, None, exc
    return triton, tl, None


TRITON_IMPORTS = import_triton()[0] is not None  # once: no import statement in a traced (compiled) forward


def triton_available() -> bool:
    """True when Triton kernels can run: Triton imports and CUDA is available or ``TRITON_INTERPRET=1``."""
    return TRITON_IMPORTS and (TRITON_INTERPRET or torch.cuda.is_available())


def triton_runs_on(device: torch.device) -> bool:
    """True when the kernels can run on tensors of ``device``: CUDA, or CPU under ``TRITON_INTERPRET=1``."""
    return triton_available() and (device.type == "cuda" or (TRITON_INTERPRET and device.type == "cpu"))


def resolve_backend(backend: str | None, device: torch.device, config_backend: str | None = None, *,
                    kernels_imported: bool = True, op: str = __name__) -> str:
    """Pick the implementation of an op: the one place that decides, for every op.

    ========================  =====================================================================
    precedence                where it comes from
    ========================  =====================================================================
    1. ``backend``            the op's ``backend=`` argument
    2. ``$DEPTHFUSION_BACKEND``  the environment variable (an override for a whole process)
    3. ``config_backend``     the model config's ``op_backend`` field (a model passes it)
    4. automatic              Triton for CUDA tensors when the kernel imports, else PyTorch
    ========================  =====================================================================

    A model calls this once per forward pass and device with ``backend=None`` (:func:`backend_per_device`); that
    choice is logged at DEBUG (an explicit ``backend`` is not logged: ops called with a resolved backend stay silent).

    Args:
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` (any case) or None.
        device: the device of the op's tensors.
        config_backend: the config's ``op_backend`` (same values), used when neither ``backend`` nor the
            environment variable is set.
        kernels_imported: False when the op's kernel module failed to import (its Triton backend runs nowhere).
        op: the op's module name, for the log.
    Returns:
        ``"reference"``, ``"torch"`` or ``"triton"``.
    Raises:
        ValueError: for an unknown name, or ``"triton"`` where the kernel cannot run (no Triton, or
            tensors on a device other than CUDA without ``TRITON_INTERPRET=1``).
    """
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV_VAR) or config_backend or "auto"
    if not isinstance(choice, str):
        raise ValueError(f"backend must be one of {OP_BACKENDS} or None; got {choice!r}")
    choice = choice.lower()
    available = kernels_imported and triton_available()
    if choice == "auto":
        choice = "triton" if device.type == "cuda" and available else "torch"
    elif choice not in BACKENDS:
        raise ValueError(f"backend must be one of {OP_BACKENDS}, got {choice!r}")
    elif choice == "triton" and not available:
        raise ValueError("backend='triton' was requested but Triton (or its kernel module) is not available")
    elif choice == "triton" and not triton_runs_on(device):
        raise ValueError(
            f"backend='triton' runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); got device {device}"
        )
    if backend is None and not torch.compiler.is_compiling():  # a log call would break a compiled graph
        logger.debug("%s: backend %r on %s", op, choice, device)
    return choice


def backend_per_device(resolve: Callable[..., str], config_backend: str | None) -> Callable[[torch.device], str]:
    """The rule every model follows: its op's backend (``resolve(None, device, config_backend)``) chosen once per
    forward pass and device (with ``device_map`` the layers may sit on several devices, and the choice depends on
    the device). Returns ``backend_on(device) -> str``; make one at the start of each forward."""
    chosen: dict[torch.device, str] = {}

    def backend_on(device: torch.device) -> str:
        if device not in chosen:
            chosen[device] = resolve(None, device, config_backend)
        return chosen[device]

    return backend_on
