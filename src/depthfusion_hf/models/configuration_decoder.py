"""The base of every causal family config (``DecoderConfigMixin``: Llama's fields, ``backbone_config``, the shared
validation) and the checks it runs: the Llama fields' shapes and values, ``op_backend``, and unknown options that look
like a depth-fusion option."""

from __future__ import annotations

import dataclasses
import difflib
from typing import ClassVar

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.configuration_llama import LlamaConfig

from .backbones import BACKBONES, DEFAULT_BACKBONE, as_backbone_config
from .depthfusion_common import OP_BACKENDS, check_positive_int, check_real
from .transformers_compat import SubConfigSpec

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# Rope parameters that scale or count something: a value <= 0 gives NaN or meaningless positions.
POSITIVE_ROPE_PARAMETERS = ("rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
                            "high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "partial_rotary_factor",
                            "short_factor", "long_factor")


def family_options(config_class: type) -> list[str]:
    """The fields a decoder config adds to Llama's (its options), sorted."""
    return sorted(f.name for f in dataclasses.fields(config_class) if f.name not in LlamaConfig.__dataclass_fields__)


def one_typo_apart(key: str, name: str) -> bool:
    """True when ``key`` is ``name`` with one letter deleted, inserted, replaced, or two neighbours swapped."""
    if abs(len(key) - len(name)) > 1 or key == name:
        return False
    short, long = sorted((key, name), key=len)
    first = next((i for i, (a, b) in enumerate(zip(short, long)) if a != b), len(short))
    if len(short) < len(long):
        return short[first:] == long[first + 1:]
    swapped = short[first + 1: first + 2] + short[first: first + 1]
    return short[first + 1:] == long[first + 1:] or (long[first: first + 2] == swapped
                                                      and short[first + 2:] == long[first + 2:])


def check_unknown_options(config_class: type, extra_keys) -> None:
    """Raise a ValueError for a key of ``extra_keys`` (config arguments that are no field of ``config_class``) that
    looks like a depth-fusion option: a near miss of one of the class's options (one typo away, or a difflib ratio
    >= 0.85), a key starting with its
    ``option_prefix`` (``hc_iters`` for mHC's ``hc_sinkhorn_iters``), or an option or prefix of another decoder
    config (each registers itself by subclassing :class:`DecoderConfigMixin`: no list to extend).

    Other unknown keys pass: transformers and users keep their own keys in configs (``auto_map``, ``torch_dtype``,
    tokenizer ids, notes). The error names the key and the nearest valid field.
    """
    prefix = getattr(config_class, "option_prefix", None)
    if not isinstance(prefix, str) or not prefix:
        raise TypeError(f"{config_class.__name__} must set `option_prefix`, the prefix of its option names")
    options = family_options(config_class)
    others = [other for other in decoder_configs() if not issubclass(config_class, other)]
    for key in extra_keys:
        near_option = ([name for name in options if one_typo_apart(key, name)]
                       or difflib.get_close_matches(key, options, n=1, cutoff=0.85))
        if not near_option and key.startswith(prefix):  # the option holding its words, else the closest name
            words = set(key.removeprefix(prefix).split("_"))
            near_option = [name for name in options if words <= set(name.split("_"))]
            near_option = near_option or difflib.get_close_matches(key, options, n=1, cutoff=0.0)
        if near_option:
            problem = f"a misspelt option? The nearest valid name is `{near_option[0]}`"
        else:
            owner = next((other for other in others
                          if key.startswith(other.option_prefix) or key in family_options(other)), None)
            if owner is None:
                continue
            problem = (f"it looks like an option of another depth-fusion family ({owner.model_type!r}: "
                       f"{owner.option_prefix!r}...), whose configs say their own model_type")
        raise ValueError(f"`{key}` is not a field of {config_class.__name__} (model_type "
                         f"{config_class.model_type!r}): {problem}. This family's options: {options}")


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


def check_op_backend(config: LlamaConfig) -> None:
    """Validate ``op_backend``: None or one of ``OP_BACKENDS`` (any case); raise a ValueError naming it."""
    value = config.op_backend
    if value is not None and (not isinstance(value, str) or value.lower() not in OP_BACKENDS):
        raise ValueError(f"`op_backend` must be None or one of {OP_BACKENDS}; got {value!r}")


# With a backbone_config, these top-level (Llama) fields mirror the backbone's (the family's own code reads them).
MIRRORED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "initializer_range",
                   "attention_dropout", "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id")
# ... and these are copied: transformers' caches are made like the backbone's (sliding-window layers), and vLLM's
# Transformers backend reads the logit softcapping at the top level (its own LM head; vllm 0.32,
# model_executor/models/transformers/causal.py and base.py).
COPIED_FIELDS = ("layer_types", "sliding_window", "final_logit_softcapping", "attn_logit_softcapping")


@strict
class DecoderConfigMixin(LlamaConfig):
    """The base of every causal family config: Llama's fields, ``backbone_config``, and the shared validation.

    ``backbone_config`` (a config of a supported decoder, :data:`backbones.BACKBONES`, or None) names the decoder the
    family is built on; None means the family config is itself the (Llama) decoder's config. With one, the top-level
    sizes (``hidden_size``, ``num_hidden_layers``, ...; :data:`MIRRORED_FIELDS`) are the backbone's: give them in
    ``backbone_config`` (a different top-level value is an error naming both).

    A subclass sets ``option_prefix`` (the prefix of its own option names, e.g. ``"hc_"``) and implements
    ``check_family_fields``; ``check_fields`` runs the Llama checks, ``op_backend``'s and the family's.
    """

    option_prefix: ClassVar[str]
    supported_backbones: ClassVar[tuple[str, ...]] = BACKBONES
    if SubConfigSpec is not None:
        sub_configs_defaults = {"backbone_config": SubConfigSpec(config_class=AutoConfig, model_type=DEFAULT_BACKBONE,
                                                                 optional=True)}

    backbone_config: dict | PreTrainedConfig | None = None

    @property
    def sub_configs(self) -> dict:
        """The sub-configs transformers walks (``attn_implementation``; tests that set RoPE on each):
        ``backbone_config`` where the family is built on one; none for a Llama family config (its own decoder)."""
        return {"backbone_config": AutoConfig} if self.__dict__.get("backbone_config") is not None else {}

    @property
    def base_model_tp_plan(self) -> dict | None:
        """The backbone's tensor-parallel plan (Phi-3's fused projections, OLMo 2's q/k norms over all heads, ...),
        or Llama's: the family keeps the backbone's module names. One set on the config (transformers adds the
        embeddings' rule to it when they are tied) is kept, like a class plan, out of ``config.json``."""
        if "base_model_tp_plan" in self.__dict__:
            return self.__dict__["base_model_tp_plan"]
        backbone = self.__dict__.get("backbone_config")
        return (backbone if isinstance(backbone, PreTrainedConfig) else LlamaConfig).base_model_tp_plan

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan: dict | None) -> None:
        self.__dict__["base_model_tp_plan"] = plan

    def __post_init__(self, **kwargs):
        # Validation lives in `check_fields` rather than in `validate_*` methods: strict-dataclass validators
        # wrap errors in a non-ValueError exception. It runs before Llama's `__post_init__` (which divides by
        # `num_attention_heads`) and again after it (which folds a legacy `rope_theta` into `rope_parameters`).
        check_unknown_options(type(self), kwargs)
        self.backbone_config = as_backbone_config(self.backbone_config, self.supported_backbones)
        self.mirror_backbone()
        self.check_fields()
        super().__post_init__(**kwargs)
        self.check_fields()

    def __setattr__(self, name, value):
        # A top-level size set later (``resize_token_embeddings`` sets ``vocab_size``) is the backbone's too.
        super().__setattr__(name, value)
        backbone = self.__dict__.get("backbone_config")
        if name in MIRRORED_FIELDS and isinstance(backbone, PreTrainedConfig) and hasattr(backbone, name):
            setattr(backbone, name, value)

    def mirror_backbone(self) -> None:
        """Copy the backbone's sizes to the top-level fields; a top-level value set to something else than both
        Llama's default and the backbone's is a ValueError."""
        if self.backbone_config is None:
            return
        for name in MIRRORED_FIELDS:
            if not hasattr(self.backbone_config, name):
                continue
            value, backbone_value = getattr(self, name), getattr(self.backbone_config, name)
            if value not in (backbone_value, LlamaConfig.__dataclass_fields__[name].default):
                raise ValueError(f"`{name}` is {value!r} but backbone_config.{name} is {backbone_value!r}: with a "
                                 f"backbone_config the decoder's sizes are the backbone's; set them there")
            setattr(self, name, backbone_value)
        for name in COPIED_FIELDS:
            if getattr(self.backbone_config, name, None) is not None:
                setattr(self, name, getattr(self.backbone_config, name))

    def check_fields(self) -> None:
        """Raise a ValueError naming an invalid field and its allowed values; also run when a model is built
        (a field changed after construction, e.g. ``config.hc_mult = 0``, gets the construction error)."""
        check_backbone_mirrors(self)
        check_llama_shapes(self)
        check_llama_values(self)
        check_op_backend(self)
        self.check_family_fields()

    def check_family_fields(self) -> None:
        """Validate the family's own options; raise a ValueError naming the field and its allowed values."""
        raise NotImplementedError


def check_backbone_mirrors(config: DecoderConfigMixin) -> None:
    """A size of ``backbone_config`` changed after construction must be the top-level one too (setting the top-level
    field sets both)."""
    backbone = config.backbone_config
    if backbone is None or isinstance(backbone, dict):
        return
    for name in MIRRORED_FIELDS:
        if hasattr(backbone, name) and getattr(config, name) != getattr(backbone, name):
            raise ValueError(f"`{name}` is {getattr(config, name)!r} but backbone_config.{name} is "
                             f"{getattr(backbone, name)!r}: set the top-level `{name}` (it sets both)")


def decoder_configs() -> list[type]:
    """Every class below :class:`DecoderConfigMixin` that declares its ``option_prefix`` (read from the class tree,
    no registry; a class without one is refused when built, by :func:`check_unknown_options`)."""
    found, pending = [], DecoderConfigMixin.__subclasses__()
    while pending:
        cls = pending.pop(0)
        pending += cls.__subclasses__()
        if isinstance(cls.__dict__.get("option_prefix"), str) and cls.option_prefix:
            found.append(cls)
    return found
