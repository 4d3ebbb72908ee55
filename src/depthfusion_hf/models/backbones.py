"""The transformers decoders a causal family can be built on ("backbones"), and the seams the families need.

A family config names its backbone with ``backbone_config`` (a config of the decoder's own class; None: the family
config is itself a Llama config, as every config saved before backbones existed). The family model is then built from
the backbone's own modules: transformers' ``AutoModel`` class for that config builds the embeddings, decoder layers,
final norm and rotary embeddings (with their biases, q/k norms, sliding windows, per-layer attention types, embedding
scale), and the family keeps them under the backbone's names, so a checkpoint of the backbone converts by copying its
state dict. The depth mechanism is the only code of ours:

- DenseFormer reads layer outputs only: it runs the backbone's layers as they are;
- AttnRes and mHC replace the residual around each *sub-layer*: :func:`attention_branch` and :func:`mlp_branch` are a
  decoder layer split into its two branches, ``layer(x) = h + mlp_branch(h)`` with ``h = x + attention_branch(x)``,
  declared once per layer shape (:data:`LAYER_SHAPES`), not per model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers import CONFIG_MAPPING, PreTrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from .transformers_compat import cache_kwarg


@dataclass(frozen=True)
class LayerShape:
    """Where a decoder layer's norms and dropouts sit around its two branches: the names of the layer's modules
    applied, in order, to a branch's input (``*_in``) and to its output (``*_out``)."""

    attention_in: tuple[str, ...]
    attention_out: tuple[str, ...]
    mlp_in: tuple[str, ...]
    mlp_out: tuple[str, ...]


LAYER_SHAPES = {
    # Llama, Mistral, Qwen2, Qwen3: x + attn(norm(x)), then h + mlp(norm(h))
    "pre_norm": LayerShape(("input_layernorm",), (), ("post_attention_layernorm",), ()),
    # Phi-3: pre-norm with a dropout on each branch's output
    "pre_norm_dropout": LayerShape(("input_layernorm",), ("resid_attn_dropout",), ("post_attention_layernorm",),
                                   ("resid_mlp_dropout",)),
    # Gemma 3: a norm before and after each branch
    "sandwich_norm": LayerShape(("input_layernorm",), ("post_attention_layernorm",), ("pre_feedforward_layernorm",),
                                ("post_feedforward_layernorm",)),
    # OLMo 2: a norm after each branch only
    "post_norm": LayerShape((), ("post_attention_layernorm",), (), ("post_feedforward_layernorm",)),
}

# The supported backbones' model_type -> layer shape. MoDA extends the attention itself (MODA_BACKBONES).
BACKBONE_LAYER_SHAPES = {
    "llama": "pre_norm",
    "mistral": "pre_norm",
    "qwen2": "pre_norm",
    "qwen3": "pre_norm",
    "phi3": "pre_norm_dropout",
    "gemma3_text": "sandwich_norm",
    "olmo2": "post_norm",
}
BACKBONES = tuple(BACKBONE_LAYER_SHAPES)
# Their decoder layers' class names (``_no_split_modules``: device_map and FSDP keep a layer on one device).
BACKBONE_LAYER_NAMES = ["LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                        "Phi3DecoderLayer", "Gemma3DecoderLayer", "Olmo2DecoderLayer"]
DEFAULT_BACKBONE = "llama"
# transformers' mask builder of each attention type in ``layer_types``.
MASK_FUNCTIONS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def as_backbone_config(value: PreTrainedConfig | dict | None, allowed: tuple[str, ...] = BACKBONES):
    """``backbone_config`` as a config object (a dict is read by its ``model_type``), or None (the family config is
    the Llama config itself). Raises a ValueError naming the model_type and the allowed ones."""
    if value is None:
        return None
    if isinstance(value, dict):
        fields = dict(value)
        model_type = fields.pop("model_type", None)
        if model_type not in allowed:
            raise ValueError(f"backbone_config's model_type must be one of {list(allowed)}; got {model_type!r}")
        return CONFIG_MAPPING[model_type](**fields)
    if not isinstance(value, PreTrainedConfig):
        raise ValueError(f"backbone_config must be None, a dict or a transformers config of one of {list(allowed)}; "
                         f"got {type(value).__name__}")
    if value.model_type not in allowed:
        raise ValueError(f"backbone_config's model_type must be one of {list(allowed)}; got {value.model_type!r} "
                         f"({type(value).__name__})")
    if getattr(value, "use_bidirectional_attention", False):
        raise ValueError("backbone_config.use_bidirectional_attention must be False: the families are causal LMs")
    return value


def decoder_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """The config the backbone's modules read: ``config.backbone_config``, or the (Llama) family config itself."""
    return getattr(config, "backbone_config", None) or config


def backbone_type(config: PreTrainedConfig) -> str:
    """The backbone's model_type (``"llama"`` for a family config without ``backbone_config``)."""
    backbone = getattr(config, "backbone_config", None)
    return DEFAULT_BACKBONE if backbone is None else backbone.model_type


def backbone_model_class(config: PreTrainedConfig) -> type:
    """The backbone's base model class (``LlamaModel``, ``Qwen3Model``, ``Gemma3TextModel``, ...)."""
    return MODEL_MAPPING[CONFIG_MAPPING[backbone_type(config)]]


def build_backbone(config: PreTrainedConfig) -> nn.Module:
    """The backbone's base model built from ``decoder_config(config)``; the family takes its ``embed_tokens``,
    ``layers``, ``norm`` and ``rotary_emb``. The legacy ``config.gradient_checkpointing = True``, which a model's
    ``post_init`` consumes (and deletes), is left for the family model's own ``post_init``: its layers are the ones
    to checkpoint."""
    decoder = decoder_config(config)
    legacy_checkpointing = getattr(decoder, "gradient_checkpointing", None)
    backbone = uninitialised_class(backbone_model_class(config))(decoder)
    if legacy_checkpointing is not None:
        decoder.gradient_checkpointing = legacy_checkpointing
    return backbone


@functools.cache
def uninitialised_class(model_class: type) -> type:
    """``model_class`` whose ``post_init`` leaves the weights as constructed: the family model's own ``post_init``
    initialises every weight once, in the family's module order (a seeded family model is the one built before
    backbones existed)."""
    return type(model_class.__name__, (model_class,), {"init_weights": lambda self: None})


def init_backbone_weights(model: nn.Module, module: nn.Module) -> None:
    """The backbone's own weight initialisation of ``module`` (Gemma 3's norms start at 0, Llama's at 1, ...), run by
    a bare instance of the backbone's model class that holds only the config (its ``_init_weights`` reads nothing
    else, and may call ``super()``, which needs an instance of that class)."""
    model_class = backbone_model_class(model.config)
    initializer = model_class.__new__(model_class)
    nn.Module.__init__(initializer)
    initializer.config = decoder_config(model.config)
    initializer._init_weights(module)


def layer_types(config: PreTrainedConfig) -> list[str]:
    """Each decoder layer's attention type: the backbone's ``layer_types``, else ``"sliding_attention"`` for every
    layer where the config has a ``sliding_window`` (Mistral, Phi-3), else ``"full_attention"``."""
    decoder = decoder_config(config)
    types = getattr(decoder, "layer_types", None)
    if types is None:
        sliding = getattr(decoder, "sliding_window", None) is not None
        types = ["sliding_attention" if sliding else "full_attention"] * decoder.num_hidden_layers
    return list(types)


def layer_inputs(model: nn.Module, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | dict | None,
                 cache, position_ids: torch.LongTensor) -> list[dict]:
    """Per decoder layer, its ``attention_mask`` (the causal or sliding-window mask of its attention type) and its
    ``position_embeddings`` (the rotary cos, sin [B or 1, T, head_dim]; Gemma 3 has one per attention type), as the
    backbone's own model forward makes them."""
    decoder = decoder_config(model.config)
    types = layer_types(model.config)
    mask_kwargs = dict(config=decoder, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                       position_ids=position_ids, **cache_kwarg(cache))
    if isinstance(attention_mask, dict):  # generate() made them already, one per attention type (a static cache)
        masks = attention_mask
    else:
        masks = {kind: MASK_FUNCTIONS[kind](**mask_kwargs) for kind in set(types)}
    if hasattr(model.rotary_emb, "layer_types"):  # Gemma 3: one rotary embedding per attention type
        rotary = {kind: model.rotary_emb(inputs_embeds, position_ids, kind) for kind in set(types)}
    else:
        shared = model.rotary_emb(inputs_embeds, position_ids=position_ids)
        rotary = dict.fromkeys(set(types), shared)
    return [{"attention_mask": masks[kind], "position_embeddings": rotary[kind]} for kind in types]


def branch_shape(config: PreTrainedConfig) -> LayerShape:
    """The layer shape of ``config``'s backbone (:data:`BACKBONE_LAYER_SHAPES`)."""
    return LAYER_SHAPES[BACKBONE_LAYER_SHAPES[backbone_type(config)]]


def apply_modules(layer: nn.Module, names: tuple[str, ...], hidden_states: torch.Tensor) -> torch.Tensor:
    for name in names:
        hidden_states = getattr(layer, name)(hidden_states)
    return hidden_states


def attention_branch(layer: nn.Module, shape: LayerShape, hidden_states: torch.Tensor,
                     **attention_kwargs) -> torch.Tensor:
    """The attention branch of a decoder layer of ``shape``, [B, T, D] -> [B, T, D]: what it adds to its residual;
    ``attention_kwargs`` (mask, rotary, cache, ...) go to its ``self_attn``."""
    output, _ = layer.self_attn(hidden_states=apply_modules(layer, shape.attention_in, hidden_states),
                                **attention_kwargs)
    return apply_modules(layer, shape.attention_out, output)


def mlp_branch(layer: nn.Module, shape: LayerShape, hidden_states: torch.Tensor) -> torch.Tensor:
    """The MLP branch of a decoder layer of ``shape``, [B, T, D] -> [B, T, D]: what it adds to its residual."""
    return apply_modules(layer, shape.mlp_out, layer.mlp(apply_modules(layer, shape.mlp_in, hidden_states)))


def adopt_layer(target: nn.Module, layer: nn.Module) -> None:
    """Make ``layer``'s modules (attention, MLP, norms, dropouts) ``target``'s, under the same names, so ``target``'s
    state dict is the backbone layer's plus its own."""
    for name, module in layer.named_children():
        target.add_module(name, module)


def add_logit_softcapping(lm_head: nn.Module, config: PreTrainedConfig) -> None:
    """Gemma 3's final ``logits = cap * tanh(logits / cap)`` where the backbone has ``final_logit_softcapping``."""
    cap = getattr(decoder_config(config), "final_logit_softcapping", None)
    if cap is not None:
        lm_head.register_forward_hook(lambda module, args, logits: torch.tanh(logits / cap) * cap)


__all__ = ["BACKBONES", "LAYER_SHAPES", "MASK_FUNCTIONS", "adopt_layer", "as_backbone_config", "attention_branch",
           "backbone_type", "branch_shape", "build_backbone", "decoder_config", "init_backbone_weights", "layer_inputs",
           "layer_types", "mlp_branch"]
