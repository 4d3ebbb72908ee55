"""MoDA configuration: a Llama-style decoder plus the mixture-of-depths attention knobs."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

OP_BACKENDS = ("auto", "reference", "torch", "triton")

NORM_POSITIONS = ("pre", "post")


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
class MoDAConfig(LlamaConfig):
    r"""Configuration of a MoDA decoder (Zhu et al., 2026, arXiv 2603.15619).

    A Llama decoder (RMSNorm, RoPE, SwiGLU, GQA; every Llama field keeps its meaning) whose attention
    also reads, in the same softmax, the depth stream of the query's own token: the attention K/V of
    every earlier layer and, with ``moda_ffn_kv``, one FFN-side K/V pair per earlier layer.

    Args:
        moda_ffn_kv (`bool`, defaults to True): add the paper's "Extra FFN KV Proj.": each layer
            except the last (whose entry no layer reads) projects its FFN input ``D -> 2 * Hkv * d``
            to one more depth K/V pair. Layer ``l`` then reads ``2 l`` depth entries (``l`` without).
        norm_position (`str`, defaults to ``"pre"``): ``"pre"`` is Llama's pre-norm block;
            ``"post"`` is the classic post-norm block ``h = norm(x + attn(x)); y = norm(h + mlp(h))``,
            which the paper finds gains more from MoDA. Allowed: ``"pre"``, ``"post"``.
        moda_depth_window (`int` or None, defaults to None): W, keep only the depth entries written by
            the last ``W`` layers (layer ``l`` reads those of layers ``max(0, l - W) .. l - 1``), so the
            depth cost grows as ``L W`` instead of ``L^2`` (the paper's §6.2 direction). None reads every
            earlier layer (the paper's MoDA). Allowed: None or ``1 <= W <= num_hidden_layers``.
        op_backend (`str` or None, defaults to None): which implementation of the family's op runs:
            ``"reference"`` (the paper's loop), ``"torch"`` (vectorised PyTorch), ``"triton"`` (the fused
            kernel, CUDA), or None / ``"auto"`` (Triton for CUDA tensors when it imports, else PyTorch). An
            op's ``backend=`` argument and ``$DEPTHFUSION_BACKEND`` take precedence over it.

    Example:
        >>> config = MoDAConfig(num_hidden_layers=36, hidden_size=1024, norm_position="post")
    """

    model_type = "moda"
    # Differs from Llama: the FFN-side depth K/V projection is laid out head-major ([Hkv, 2, d]), so a
    # column-wise shard holds whole heads, like k_proj / v_proj.
    base_model_tp_plan = {**LlamaConfig.base_model_tp_plan, "layers.*.ffn_kv_proj": "colwise"}

    moda_ffn_kv: bool = True
    norm_position: str = "pre"
    moda_depth_window: int | None = None
    op_backend: str | None = None

    # Copied from depthfusion_hf.models.denseformer.configuration_denseformer.DenseFormerConfig.__post_init__
    def __post_init__(self, **kwargs):
        # Validation lives in `check_fields` rather than in `validate_*` methods: strict-dataclass validators
        # wrap errors in a non-ValueError exception.
        self.check_fields()
        super().__post_init__(**kwargs)

    def check_fields(self) -> None:
        """Validate every field; raise a ValueError naming the field and its allowed values.

        Runs at construction and again when a model is built from this config, so that a field
        changed after construction (e.g. ``config.moda_depth_window = 0``) gets the same error.
        """
        check_llama_shapes(self)
        check_op_backend(self)
        if not isinstance(self.moda_ffn_kv, bool):
            raise ValueError(f"`moda_ffn_kv` must be a bool (True or False); got {self.moda_ffn_kv!r}")
        if self.norm_position not in NORM_POSITIONS:
            raise ValueError(f"`norm_position` must be one of {NORM_POSITIONS}; got {self.norm_position!r}")
        if self.attention_dropout:
            raise ValueError(
                f"`attention_dropout` must be 0.0 (the MoDA op has no dropout); got {self.attention_dropout!r}"
            )
        if self.moda_depth_window is not None:
            check_positive_int("moda_depth_window", self.moda_depth_window, self.num_hidden_layers,
                               "at most num_hidden_layers, or None for all earlier layers")


__all__ = ["MoDAConfig"]
