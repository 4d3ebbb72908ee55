"""AttnRes configuration: a Llama-style decoder whose residual sums are Attention Residuals (full or block)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

OP_BACKENDS = ("auto", "reference", "torch", "triton")


# Copied from depthfusion_hf.models.denseformer.configuration_denseformer.check_positive_int
def check_positive_int(name: str, value, upper: int | None = None, upper_name: str | None = None) -> None:
    """Raise a ValueError naming ``name`` unless ``1 <= value (<= upper)``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper is not None and value > upper):
        allowed = f"an integer in [1, {upper}] ({upper_name})" if upper is not None else "an integer >= 1"
        raise ValueError(f"`{name}` must be {allowed}; got {value!r}")


# Copied from depthfusion_hf.models.denseformer.configuration_denseformer.check_llama_shapes
def check_llama_shapes(config: LlamaConfig) -> None:
    """Validate the Llama-style fields shared by our decoders; raise a ValueError naming the field."""
    check_positive_int("vocab_size", config.vocab_size)
    check_positive_int("hidden_size", config.hidden_size)
    check_positive_int("intermediate_size", config.intermediate_size)
    check_positive_int("num_hidden_layers", config.num_hidden_layers)
    check_positive_int("num_attention_heads", config.num_attention_heads)
    if config.head_dim is None and config.hidden_size % config.num_attention_heads != 0:
        raise ValueError(
            f"`hidden_size` ({config.hidden_size}) must be divisible by `num_attention_heads` "
            f"({config.num_attention_heads}), or set `head_dim` explicitly"
        )
    if config.num_key_value_heads is not None:
        check_positive_int("num_key_value_heads", config.num_key_value_heads, config.num_attention_heads,
                           "at most num_attention_heads")
        if config.num_attention_heads % config.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({config.num_attention_heads}) must be a multiple of "
                f"`num_key_value_heads` ({config.num_key_value_heads})"
            )
    if config.head_dim is not None and (config.head_dim < 2 or config.head_dim % 2 != 0):
        raise ValueError(f"`head_dim` must be an even integer >= 2 (RoPE rotates pairs); got {config.head_dim}")


# Copied from depthfusion_hf.models.denseformer.configuration_denseformer.check_op_backend
def check_op_backend(config: LlamaConfig) -> None:
    """Validate ``op_backend``: None or one of ``OP_BACKENDS`` (any case); raise a ValueError naming it."""
    value = config.op_backend
    if value is not None and (not isinstance(value, str) or value.lower() not in OP_BACKENDS):
        raise ValueError(f"`op_backend` must be None or one of {OP_BACKENDS}; got {value!r}")


@strict
class AttnResConfig(LlamaConfig):
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

    attnres_block_size: int | None = None
    op_backend: str | None = None

    # Copied from depthfusion_hf.models.denseformer.configuration_denseformer.DenseFormerConfig.__post_init__
    def __post_init__(self, **kwargs):
        # Validation lives in `check_fields` rather than in `validate_*` methods: strict-dataclass validators
        # wrap errors in a non-ValueError exception.
        self.check_fields()
        super().__post_init__(**kwargs)

    def check_fields(self) -> None:
        """Run every validation of this config (also after a field was changed); raise a ValueError naming it."""
        check_llama_shapes(self)
        check_op_backend(self)
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
