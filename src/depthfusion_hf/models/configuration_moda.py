"""MoDA configuration: a Llama-style decoder plus the mixture-of-depths attention knobs."""

from __future__ import annotations

import dataclasses
import difflib
import math

from huggingface_hub.dataclasses import strict
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.configuration_llama import LlamaConfig

OP_BACKENDS = ("auto", "reference", "torch", "triton")
# Prefixes of the depth-fusion families' own options. An unknown config key that starts with one, or is a near
# miss of this family's options, is a misspelt or foreign option: stored and ignored, it would give a default model.
FAMILY_OPTION_PREFIXES = ("dwa_", "moda_", "attnres_", "mhc_", "norm_position")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# Rope parameters that scale or count something: a value <= 0 gives NaN or meaningless positions.
POSITIVE_ROPE_PARAMETERS = ("rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
                            "high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "partial_rotary_factor",
                            "short_factor", "long_factor")

NORM_POSITIONS = ("pre", "post")


# Copied from depthfusion_hf.models.configuration_denseformer.check_positive_int
def check_positive_int(name: str, value, upper: int | None = None, upper_name: str | None = None) -> None:
    """Raise a ValueError naming ``name`` unless ``1 <= value (<= upper)``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper is not None and value > upper):
        allowed = f"an integer in [1, {upper}] ({upper_name})" if upper is not None else "an integer >= 1"
        raise ValueError(f"`{name}` must be {allowed}; got {value!r}")


# Copied from depthfusion_hf.models.configuration_denseformer.check_real
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


# Copied from depthfusion_hf.models.configuration_denseformer.check_unknown_options
def check_unknown_options(config_class: type, extra_keys) -> None:
    """Raise a ValueError for a key of ``extra_keys`` (config arguments that are no field of ``config_class``) that
    looks like a depth-fusion option: a near miss of one of the class's own options, or a family option prefix.

    Other unknown keys pass: transformers and users keep their own keys in configs (``auto_map``, ``torch_dtype``,
    tokenizer ids, notes). The error names the key and the nearest valid field.
    """
    fields = sorted(field.name for field in dataclasses.fields(config_class))
    options = [name for name in fields if name not in LlamaConfig.__dataclass_fields__]
    for key in extra_keys:
        near_option = difflib.get_close_matches(key, options, n=1, cutoff=0.85)
        if not near_option and not key.startswith(FAMILY_OPTION_PREFIXES):
            continue
        if near_option:
            problem = f"a misspelt option? The nearest valid name is `{near_option[0]}`"
        else:
            prefix = next(prefix for prefix in FAMILY_OPTION_PREFIXES if key.startswith(prefix))
            problem = (f"it looks like an option of another depth-fusion family ({prefix!r}...), whose configs say "
                       "their own model_type")
        raise ValueError(f"`{key}` is not a field of {config_class.__name__} (model_type "
                         f"{config_class.model_type!r}): {problem}. This family's options: {options}")


# Copied from depthfusion_hf.models.configuration_denseformer.check_llama_shapes
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
    check_positive_int("max_position_embeddings", config.max_position_embeddings)


# Copied from depthfusion_hf.models.configuration_denseformer.check_llama_values
def check_llama_values(config: LlamaConfig) -> None:
    """Validate the inherited Llama fields that are not shapes (norm eps, activation, dropout, special token ids,
    dtype, RoPE); raise a ValueError naming the field and its allowed values.

    Each of these was accepted before and gave NaN logits (``rms_norm_eps`` NaN or <= 0, ``rope_theta`` <= 0), a
    bare ``KeyError`` (``hidden_act``), an assertion (a pad id past the vocabulary) or, for a negative id, a
    silently different padding row. ``rope_parameters`` is checked once set (Llama's ``__post_init__`` folds the
    legacy ``rope_theta`` / ``rope_scaling`` keys into it).
    """
    check_real("rms_norm_eps", config.rms_norm_eps, 0.0)
    if config.hidden_act not in ACT2FN:
        raise ValueError(f"`hidden_act` must be one of {sorted(ACT2FN)}; got {config.hidden_act!r}")
    check_real("attention_dropout", config.attention_dropout, 0.0, 1.0, closed_lower=True)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, name)
        for token in value if isinstance(value, list) else [value]:
            if token is not None and (isinstance(token, bool) or not isinstance(token, int)
                                      or not 0 <= token < config.vocab_size):
                raise ValueError(f"`{name}` must be None or an integer in [0, vocab_size={config.vocab_size})"
                                 f"{' (or a list of them)' if name == 'eos_token_id' else ''}; got {value!r}")
    dtype = config.dtype
    if dtype is not None and str(dtype).removeprefix("torch.") not in FLOAT_DTYPES:
        raise ValueError(f"`dtype` must be None or one of {FLOAT_DTYPES}; got {dtype!r}")
    rope = config.rope_parameters
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise ValueError(f"`rope_parameters` must be a dict (rope_type, rope_theta, ...); got {rope!r}")
    rope_types = ("default", *sorted(ROPE_INIT_FUNCTIONS))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in rope_types:
        raise ValueError(f"`rope_parameters['rope_type']` must be one of {rope_types}; got {rope_type!r}")
    for key, value in rope.items():
        for number in value if isinstance(value, list) else [value]:
            if not isinstance(number, bool) and isinstance(number, (int, float)):
                check_real(f"rope_parameters['{key}']", number, 0.0 if key in POSITIVE_ROPE_PARAMETERS else None)


# Copied from depthfusion_hf.models.configuration_denseformer.check_op_backend
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
        moda_depth_gate (`bool`, defaults to False): give every layer that reads depth entries a learned
            per-query-head gate ``g >= 0`` multiplying its depth scores in the joint softmax: ``o = (Z_s o_s +
            g Z_d o_d) / (Z_s + g Z_d)`` (``g = max(depth_gate, 0) * exp(depth_gate_log_scale)``, the log-scale a
            buffer that ``llama_to_moda`` can calibrate, else 0). Not in the paper; ``g = 0`` is Llama's attention
            exactly, which is how ``llama_to_moda`` keeps a converted model equal to its source (docs/MODA.md).
            False is the paper's MoDA.
        moda_depth_gate_init (`float`, defaults to 1.0): the gates' initial value (a finite number >= 0; 1 = the
            paper's softmax, 0 = closed). Used when the gates are initialised, not when they are loaded.
        op_backend (`str` or None, defaults to None): which implementation of the family's op runs:
            ``"reference"`` (the paper's loop), ``"torch"`` (vectorised PyTorch), ``"triton"`` (the fused
            kernel, CUDA), or None / ``"auto"`` (Triton for CUDA tensors when it imports, else PyTorch). An
            op's ``backend=`` argument and ``$DEPTHFUSION_BACKEND`` take precedence over it.

    Example:
        >>> config = MoDAConfig(num_hidden_layers=36, hidden_size=1024, norm_position="post")
    """

    model_type = "moda"

    moda_ffn_kv: bool = True
    norm_position: str = "pre"
    moda_depth_window: int | None = None
    moda_depth_gate: bool = False
    moda_depth_gate_init: float = 1.0
    op_backend: str | None = None

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """Llama's plan, plus the FFN-side depth K/V projection where the layers have one (``moda_ffn_kv``): it is
        laid out head-major ([Hkv, 2, d]), so a column-wise shard holds whole heads, like k_proj / v_proj."""
        return {**LlamaConfig.base_model_tp_plan, **({"layers.*.ffn_kv_proj": "colwise"} if self.moda_ffn_kv else {})}

    # Copied from depthfusion_hf.models.configuration_denseformer.DenseFormerConfig.__post_init__
    def __post_init__(self, **kwargs):
        # Validation lives in `check_fields` rather than in `validate_*` methods: strict-dataclass validators
        # wrap errors in a non-ValueError exception. It runs before Llama's `__post_init__` (which divides by
        # `num_attention_heads`) and again after it (which folds a legacy `rope_theta` into `rope_parameters`).
        check_unknown_options(type(self), kwargs)
        self.check_fields()
        super().__post_init__(**kwargs)
        self.check_fields()

    def check_fields(self) -> None:
        """Validate every field; raise a ValueError naming the field and its allowed values.

        Runs at construction and again when a model is built from this config, so that a field
        changed after construction (e.g. ``config.moda_depth_window = 0``) gets the same error.
        """
        check_llama_shapes(self)
        check_llama_values(self)
        check_op_backend(self)
        if not isinstance(self.moda_ffn_kv, bool):
            raise ValueError(f"`moda_ffn_kv` must be a bool (True or False); got {self.moda_ffn_kv!r}")
        if not isinstance(self.moda_depth_gate, bool):
            raise ValueError(f"`moda_depth_gate` must be a bool (True or False); got {self.moda_depth_gate!r}")
        check_real("moda_depth_gate_init", self.moda_depth_gate_init, 0.0, closed_lower=True)
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
