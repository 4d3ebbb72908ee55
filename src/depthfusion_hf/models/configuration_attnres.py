"""AttnRes configuration: a Llama-style decoder whose residual sums are Attention Residuals (full or block)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from .configuration_decoder import DecoderConfigMixin
from .depthfusion_common import check_positive_int


@strict
class AttnResConfig(DecoderConfigMixin):
    r"""Configuration of an Attention Residuals decoder (Kimi Team, 2026, arXiv 2603.15031).

    A Llama decoder (RMSNorm, RoPE, SwiGLU, GQA; every Llama field keeps its meaning) whose residual
    stream is replaced by a softmax over earlier sub-layer outputs (each attention and each MLP is one
    sub-layer, so there are ``2 * num_hidden_layers`` of them).

    Args:
        attnres_block_size (`int` or `None`, defaults to `None`): ``None`` = *full* AttnRes: each sub-layer
            input attends over the embedding and every earlier sub-layer output. An integer S = *block*
            AttnRes: the sub-layers form blocks of S, summed as usual inside a block; a sub-layer attends over
            the embedding, the earlier blocks' sums and the running sum of its own block. ``S = 1`` computes
            exactly the full variant. Allowed: ``None`` or ``1 <= S <= 2 * num_hidden_layers``.
        op_backend (`str` or None, defaults to None): which implementation of the family's op runs:
            ``"reference"`` (the paper's loop), ``"torch"`` (vectorised PyTorch), ``"triton"`` (the fused
            kernel, CUDA), or None / ``"auto"`` (Triton for CUDA tensors when it imports, else PyTorch). An
            op's ``backend=`` argument and ``$DEPTHFUSION_BACKEND`` take precedence over it.

    Example:
        >>> config = AttnResConfig(num_hidden_layers=12, attnres_block_size=3)  # 24 sub-layers, 8 blocks
    """

    model_type = "attnres"
    option_prefix = "attnres_"  # its options' names start so (a misspelt one is refused)

    attnres_block_size: int | None = None
    op_backend: str | None = None

    def check_family_fields(self) -> None:
        """Validate ``attnres_block_size``; raise a ValueError naming it (also run when a model is built)."""
        if self.attnres_block_size is not None:
            check_positive_int("attnres_block_size", self.attnres_block_size, 2 * self.num_hidden_layers,
                               "at most 2 * num_hidden_layers sub-layers; None = full AttnRes")

    @property
    def num_sublayers(self) -> int:
        """``2 * num_hidden_layers``: every attention and every MLP is one sub-layer."""
        return 2 * self.num_hidden_layers

    @property
    def effective_block_size(self) -> int:
        """The block size the model computes with: ``attnres_block_size``, or 1 for full AttnRes."""
        return 1 if self.attnres_block_size is None else self.attnres_block_size

    @property
    def num_blocks(self) -> int:
        """N, the number of blocks of sub-layers (the last one may be shorter); ``2L`` for full AttnRes."""
        return -(-self.num_sublayers // self.effective_block_size)


__all__ = ["AttnResConfig"]
