"""DenseFormer configuration: a Llama-style decoder plus the k×p Depth-Weighted Average knobs."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

OP_BACKENDS = ("auto", "reference", "torch", "triton")


def check_positive_int(name: str, value, upper: int | None = None, upper_name: str | None = None) -> None:
    """Raise a ValueError naming ``name`` unless ``1 <= value (<= upper)``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper is not None and value > upper):
        allowed = f"an integer in [1, {upper}] ({upper_name})" if upper is not None else "an integer >= 1"
        raise ValueError(f"`{name}` must be {allowed}; got {value!r}")


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


def check_op_backend(config: LlamaConfig) -> None:
    """Validate ``op_backend``: None or one of ``OP_BACKENDS`` (any case); raise a ValueError naming it."""
    value = config.op_backend
    if value is not None and (not isinstance(value, str) or value.lower() not in OP_BACKENDS):
        raise ValueError(f"`op_backend` must be None or one of {OP_BACKENDS}; got {value!r}")


@strict
class DenseFormerConfig(LlamaConfig):
    r"""Configuration of a DenseFormer (Pagliardini et al., 2024, arXiv 2402.02622).

    A Llama decoder (RMSNorm, RoPE, SwiGLU, GQA; every Llama field keeps its meaning) with a
    Depth-Weighted Average after every ``dwa_period``-th block. The DWA after block ``i`` mixes the
    block outputs ``X_j`` with ``j <= i`` and ``j ≡ i (mod dwa_dilation)`` (``X_0`` = embeddings).

    Args:
        dwa_dilation (`int`, defaults to 1): k, the dilation; 1 connects every earlier block.
            Allowed: ``1 <= k <= num_hidden_layers``.
        dwa_period (`int`, defaults to 1): p, a DWA step after block ``i`` only when ``p | i``.
            Allowed: ``1 <= p <= num_hidden_layers``.
        op_backend (`str` or None, defaults to None): which implementation of the family's op runs:
            ``"reference"`` (the paper's loop), ``"torch"`` (vectorised PyTorch), ``"triton"`` (the fused
            kernel, CUDA), or None / ``"auto"`` (Triton for CUDA tensors when it imports, else PyTorch). An
            op's ``backend=`` argument and ``$DEPTHFUSION_BACKEND`` take precedence over it.

    Example:
        >>> config = DenseFormerConfig(num_hidden_layers=12, dwa_dilation=4, dwa_period=5)
    """

    model_type = "denseformer"

    dwa_dilation: int = 1
    dwa_period: int = 1
    op_backend: str | None = None

    def __post_init__(self, **kwargs):
        # Validation lives in `check_fields` rather than in `validate_*` methods: strict-dataclass validators
        # wrap errors in a non-ValueError exception.
        self.check_fields()
        super().__post_init__(**kwargs)

    def check_fields(self) -> None:
        """Validate every field; raise a ValueError naming the field and its allowed values.

        Runs at construction and again when a model is built from this config, so that a field
        changed after construction (e.g. ``config.dwa_dilation = 0``) gets the same error.
        """
        check_llama_shapes(self)
        check_op_backend(self)
        layers = self.num_hidden_layers
        check_positive_int("dwa_dilation", self.dwa_dilation, layers, "at most num_hidden_layers")
        check_positive_int("dwa_period", self.dwa_period, layers, "at most num_hidden_layers")


__all__ = ["DenseFormerConfig"]
