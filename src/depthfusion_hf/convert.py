"""Upcycle pretrained decoders (Llama, or another supported backbone: ``models.backbones.BACKBONES``) into
depth-fusion models.

A family model is built from its backbone's own modules under their names (a DenseFormer is the backbone whose layer
loop has DWA steps in it), so conversion copies the state dict; the family's new parameters start at their
conversion init (the DWA as the identity, which makes the converted model's logits equal the source's). The
``llama_to_*`` converters take any supported backbone: a Llama source gives a family config of Llama fields (as
before backbones existed), another gives one whose ``backbone_config`` is the source's config.
"""

from __future__ import annotations

import copy
import os

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from .models.backbones import BACKBONES
from .models.configuration_denseformer import DenseFormerConfig
from .models.configuration_moda import MoDAConfig
from .models.modeling_denseformer import DenseFormerForCausalLM
from .models.modeling_moda import MoDAForCausalLM

_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")
# What loading a Llama from a folder / Hub id may be told (``from_pretrained`` keywords); anything else is refused.
LOAD_OPTIONS = ("gguf_file", "dtype", "attn_implementation") + _HUB_KWARGS


def _not_a_source(found: str) -> ValueError:
    return ValueError(
        f"expected the causal LM of a supported backbone (model_type one of {list(BACKBONES)}, e.g. a "
        f"LlamaForCausalLM); got {found}. Only those checkpoints can be converted: their weights are what the "
        "converted model reuses"
    )


def check_float_weights(model: torch.nn.Module) -> None:
    """Refuse a model whose weights are quantized: conversion copies float tensors.

    A GGUF file loaded by transformers is dequantised to float but keeps its ``quantization_config``; such a model
    passes (the converted model's config drops the setting, :func:`source_config_fields`). Packed weights (a GGUF
    kept in blocks, bitsandbytes, ...) are refused.

    Raises:
        ValueError: naming the quantization method and the first packed parameter.
    """
    packed = next((name for name, p in model.named_parameters() if not p.is_floating_point()), None)
    method = getattr(getattr(model.config, "quantization_config", None), "quant_method", None)
    method = getattr(method, "value", method)
    if packed is not None or (getattr(model, "is_quantized", False) and method != "gguf"):
        raise ValueError(
            f"the Llama holds quantized weights (quant_method {method!r}{f', e.g. {packed}' if packed else ''}); "
            "conversion needs float weights: load it unquantized, or pass the GGUF file as "
            "upcycle(folder, family, gguf_file=...)"
        )


def load_source(model_or_path: PreTrainedModel | str | os.PathLike, **load_kwargs) -> PreTrainedModel:
    """Return the causal LM of a supported backbone (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ...): the object
    itself, or loaded from a folder / Hub id (with ``gguf_file``: from
    that GGUF file in the folder / Hub repository, through its cached float copy, see
    :func:`depthfusion_hf.gguf_source.gguf_float_folder`).

    A folder is checked before any weight is loaded: its ``config.json`` must name a supported backbone's
    ``model_type``, and every weight must be found in it, so that another checkpoint (a BERT, a DenseFormer,
    a MoDA, ...) or a folder without weights is refused instead of yielding a randomly initialised model.

    Args:
        load_kwargs: :data:`LOAD_OPTIONS` only (``gguf_file``, ``dtype``, ``attn_implementation`` and the Hub
            download options), for a folder / Hub id only.
    Raises:
        ValueError: ``model_or_path`` is a model other than a supported backbone's causal LM (names its class and
            ``model_type``) or one with quantized weights, a folder whose config is not one (names the
            ``model_type`` and ``architectures`` found), or a checkpoint that lacks weights (names them);
            a loading option that is not one of :data:`LOAD_OPTIONS`, or any loading option with a model object.
        OSError: the folder / Hub id has no ``config.json`` or no weights, or no such GGUF file (from transformers).
    """
    unknown = sorted(set(load_kwargs) - set(LOAD_OPTIONS))
    if unknown:
        raise ValueError(f"unknown loading option(s) {unknown}; the loading options are {list(LOAD_OPTIONS)}")
    if isinstance(model_or_path, torch.nn.Module):
        if load_kwargs:
            raise ValueError(f"loading options {sorted(load_kwargs)} apply to a folder or Hub id; got a model object")
        # our families subclass LlamaForCausalLM: the model_type tells a backbone
        config = getattr(model_or_path, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type in BACKBONES and isinstance(model_or_path, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]):
            check_float_weights(model_or_path)
            return model_or_path
        raise _not_a_source(f"a {type(model_or_path).__name__} object (model_type {model_type!r})")
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise ValueError(f"expected a causal LM of {list(BACKBONES)}, a folder or a Hub id; got "
                         f"{type(model_or_path).__name__}")
    hub_kwargs = {key: load_kwargs[key] for key in _HUB_KWARGS if key in load_kwargs}
    gguf_file = load_kwargs.pop("gguf_file", None)
    if gguf_file is not None:
        from .gguf_source import gguf_float_folder

        model_or_path = gguf_float_folder(model_or_path, gguf_file, **hub_kwargs)
        load_kwargs = {key: value for key, value in load_kwargs.items() if key not in _HUB_KWARGS}
        hub_kwargs = {}
    config_dict, _ = PreTrainedConfig.get_config_dict(model_or_path, **hub_kwargs)
    model_type = config_dict.get("model_type")
    if model_type not in BACKBONES:
        architectures = config_dict.get("architectures")
        raise _not_a_source(f"{os.fspath(model_or_path)!r} holding model_type {model_type!r} "
                           f"(architectures {architectures})")
    source, info = AutoModelForCausalLM.from_pretrained(model_or_path, output_loading_info=True, **load_kwargs)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"{os.fspath(model_or_path)!r} has a {model_type} config but lacks {len(missing)} of its weight(s) "
            f"({shown}); converting it would start those from random values"
        )
    check_float_weights(source)
    return source


def source_config_fields(config: PreTrainedConfig) -> dict:
    """A family config's fields for a source's (or a family's) config: Llama fields (a Llama, or a family on the
    default Llama backbone), or ``{"backbone_config": the backbone's fields}`` (another backbone, or a family built on
    one). Without ``architectures``/transformers bookkeeping, and without ``quantization_config``: a converted
    model's weights are float (a GGUF load dequantises them), and the setting would make it refuse
    ``save_pretrained`` and load wrongly."""
    fields = config.to_dict()
    for key in ("architectures", "transformers_version", "auto_map", "_name_or_path", "quantization_config"):
        fields.pop(key, None)
    if fields.get("model_type") in BACKBONES and fields["model_type"] != "llama":
        return {"backbone_config": fields}
    if fields.get("backbone_config") is not None:
        return {"backbone_config": source_config_fields(config.backbone_config)["backbone_config"]}
    fields.pop("model_type", None)
    fields.pop("backbone_config", None)
    return fields


def keep_llama_settings(llama: LlamaForCausalLM, model: torch.nn.Module) -> None:
    """Give the converted ``model`` what a user relies on besides the weights: the Llama's generation config
    (e.g. ``eos_token_id=[2, 7]``, ``repetition_penalty``; without it generation stops only at the config's eos),
    its attention implementation, device, dtype (parameters and ``config.dtype``) and train / eval mode.

    The special token ids come with the config fields; a tokenizer (special tokens, chat template) is not part of
    the model: save the Llama's with the converted model (``save_remote_code_folder(model, folder, tokenizer)``).
    """
    parameter = next(llama.parameters())
    model.to(device=parameter.device, dtype=parameter.dtype)
    model.config.dtype = parameter.dtype
    if getattr(llama, "generation_config", None) is not None:
        model.generation_config = copy.deepcopy(llama.generation_config)
    model.train(llama.training)


def copy_llama_weights(source: LlamaForCausalLM, target: torch.nn.Module, new_keys: tuple[str, ...]) -> None:
    """Load the Llama's state dict into ``target``; every missing key must start with one of ``new_keys``.

    Raises:
        ValueError: if a Llama weight has no place in the target or an unexpected target weight is missing.
    """
    result = target.load_state_dict(source.state_dict(), strict=False)
    unexpected = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if not k.startswith(new_keys) and k != "lm_head.weight"]
    if unexpected or missing:
        raise ValueError(f"Llama weights do not fit the target: unexpected={unexpected}, missing={missing}")


def load_llama_start(model: torch.nn.Module, llama_state: dict[str, torch.Tensor]) -> bool:
    """Load a Llama's state dict into the family ``model`` (its own new parameters untouched) and retie the
    embeddings; returns False, changing nothing, when a Llama tensor's name or shape is not the model's."""
    own = model.state_dict()
    if any(name not in own or own[name].shape != value.shape for name, value in llama_state.items()):
        return False
    model.load_state_dict(llama_state, strict=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return True


def llama_to_denseformer(
    model_or_path: LlamaForCausalLM | str | os.PathLike,
    dwa_dilation: int = 1,
    dwa_period: int = 1,
    **load_kwargs,
) -> DenseFormerForCausalLM:
    """Convert a ``LlamaForCausalLM`` (object, folder or Hub id) into a k×p DenseFormer.

    All Llama weights are copied; the DWA weights are the identity, so the DenseFormer's logits equal
    the Llama's at conversion (up to float rounding). Continue pre-training to learn the DWA weights.

    Args:
        model_or_path: the Llama model, or anything ``LlamaForCausalLM.from_pretrained`` accepts.
        dwa_dilation: k (1 <= k <= num_hidden_layers).
        dwa_period: p (1 <= p <= num_hidden_layers).
        load_kwargs: passed to ``from_pretrained`` when a path is given.
    Returns:
        A ``DenseFormerForCausalLM`` on the Llama's device and dtype, in eval mode if the Llama was.
    """
    llama = load_source(model_or_path, **load_kwargs)
    fields = source_config_fields(llama.config)
    config = DenseFormerConfig(**fields, dwa_dilation=dwa_dilation, dwa_period=dwa_period)
    config._attn_implementation = llama.config._attn_implementation
    model = DenseFormerForCausalLM(config)
    keep_llama_settings(llama, model)
    copy_llama_weights(llama, model, new_keys=("model.dwa.",))
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


FFN_KV_INITS = ("zero", "zero_value", "copy_kv")


@torch.no_grad()
def init_ffn_kv_from_llama(model: MoDAForCausalLM, rule: str) -> None:
    """Initialise every ``ffn_kv_proj`` [2 * Hkv * d, D] (rows laid out [Hkv, 2, d]; its bias, where the layer's
    k_proj has one, likewise) by ``rule``, and every ``ffn_k_norm`` (Qwen3) as a copy of the layer's ``k_norm``.

    - ``"zero"``: key and value rows 0. Each FFN entry has logit 0 and value 0: it adds ``exp(0)`` to
      the softmax denominator and nothing to the output (an attention sink of fixed logit 0).
    - ``"zero_value"``: key rows copied from the layer's ``k_proj``, value rows 0.
    - ``"copy_kv"``: key and value rows copied from the layer's ``k_proj`` / ``v_proj``, i.e. the entry is
      what the layer's attention would write for the FFN input (on Qwen3, normalised by the copied k-norm).
    """
    if rule not in FFN_KV_INITS:
        raise ValueError(f"ffn_kv_init must be one of {FFN_KV_INITS}; got {rule!r}")
    for layer in model.model.layers:
        if not layer.writes_ffn_kv:
            continue
        weight = layer.ffn_kv_proj.weight.view(layer.num_key_value_heads, 2, layer.head_dim, -1)
        weight.zero_()
        attn = layer.self_attn
        if attn.normalises_heads:
            layer.ffn_k_norm.weight.copy_(attn.k_norm.weight)
        if rule in ("zero_value", "copy_kv"):
            weight[:, 0].copy_(attn.k_proj.weight.view(layer.num_key_value_heads, layer.head_dim, -1))
        if rule == "copy_kv":
            weight[:, 1].copy_(attn.v_proj.weight.view(layer.num_key_value_heads, layer.head_dim, -1))
        if layer.ffn_kv_proj.bias is not None:
            bias = layer.ffn_kv_proj.bias.view(layer.num_key_value_heads, 2, layer.head_dim)
            bias.zero_()
            if rule in ("zero_value", "copy_kv"):
                bias[:, 0].copy_(attn.k_proj.bias.view(layer.num_key_value_heads, layer.head_dim))
            if rule == "copy_kv":
                bias[:, 1].copy_(attn.v_proj.bias.view(layer.num_key_value_heads, layer.head_dim))


CALIBRATION_LOG_GATE = -46.0  # log(1e-20): depth weights representable in fp32 (R up to ~1e18), states unchanged


@torch.no_grad()
def calibrate_depth_gates(model: MoDAForCausalLM, input_ids: torch.LongTensor) -> None:
    """Set every gated head's ``depth_gate_log_scale`` to ``-log R``, R its median depth-to-sequence mass ratio
    ``Z_d / Z_s`` over the tokens of ``input_ids`` [B, T], measured where training starts (the hidden states of the
    closed model: the gates are opened by 1e-20 only), so that small gate values u give the typical token a depth
    share of about ``u`` in every head and an optimiser step of size lr moves it by about lr. On SmolLM2-135M, R
    spans many orders of magnitude across heads (docs/MODA.md): without this scale one Adam step of 1e-6 on the raw
    gates takes the loss from 1.66 to 2.23. The gates' values are kept.

    Raises:
        ValueError: the model has no depth gates, or ``input_ids`` is not a [B, T] integer tensor of ids in range.
    """
    attentions = {index: layer.self_attn for index, layer in enumerate(model.model.layers)
                  if layer.self_attn.depth_gate is not None}
    if not attentions:
        raise ValueError("calibrate_depth_gates needs a MoDA model with depth gates (moda_depth_gate=True)")
    if (not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.is_floating_point()
            or input_ids.numel() == 0):
        raise ValueError(f"calibration input_ids must be a non-empty [batch, tokens] integer tensor; got "
                         f"{tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__}")
    gates = {index: attn.depth_gate.detach().clone() for index, attn in attentions.items()}
    for attn in attentions.values():
        attn.depth_gate.fill_(1.0)
        attn.depth_gate_log_scale.fill_(CALIBRATION_LOG_GATE)
    try:
        weights = model.model(input_ids=input_ids.to(model.device), output_attentions=True, use_cache=False).attentions
    finally:
        for index, attn in attentions.items():
            attn.depth_gate.copy_(gates[index])
    tokens = input_ids.shape[1]
    for index, attn in attentions.items():
        joint = weights[index].float()  # [B, Hq, T, T + M]: the sequence columns first
        log_ratio = joint[..., tokens:].sum(-1).log() - joint[..., :tokens].sum(-1).log() - CALIBRATION_LOG_GATE
        median = log_ratio.transpose(0, 1).flatten(1).median(dim=1).values  # [Hq]: median log(Z_d / Z_s)
        attn.depth_gate_log_scale.copy_(-median)


def llama_to_moda(
    model_or_path: LlamaForCausalLM | str | os.PathLike,
    moda_ffn_kv: bool = True,
    ffn_kv_init: str = "zero",
    norm_position: str = "pre",
    depth_gate: bool = True,
    calibration_ids: torch.LongTensor | None = None,
    **load_kwargs,
) -> MoDAForCausalLM:
    """Convert a ``LlamaForCausalLM`` (object, folder or Hub id), or the causal LM of another backbone MoDA supports
    (``MoDAConfig.supported_backbones``: Mistral, Qwen2, Qwen3), into a pre-norm MoDA model on that backbone.

    Every source weight is copied under the same name. With ``depth_gate`` (the default) every layer that reads
    depth entries gets a learned per-head depth gate that starts closed (``moda_depth_gate=True``,
    ``moda_depth_gate_init=0.0``): the depth entries get weight exactly 0, so the converted model's logits equal
    the Llama's (float32 rounding), and continued training opens the gates (their gradient at 0 is
    ``sum_t Z_d / Z_s (o_d - o_s) . dL/do``, not small; docs/MODA.md). Without it (the paper's MoDA) each layer's
    softmax also covers the token's own attention K/V from every earlier layer at once, which on a pretrained
    model takes the attention mass away (SmolLM2-135M: perplexity 31.9 -> 27,308). The new FFN-side projections
    follow ``ffn_kv_init`` (see :func:`init_ffn_kv_from_llama`).

    Args:
        model_or_path: the Llama model, or anything ``LlamaForCausalLM.from_pretrained`` accepts.
        moda_ffn_kv: add the FFN-side depth K/V projections.
        ffn_kv_init: ``"zero"``, ``"zero_value"`` or ``"copy_kv"``.
        norm_position: must be ``"pre"``: a Llama's weights are trained for pre-norm blocks.
        depth_gate: start from closed depth gates (exact conversion); False converts to the paper's ungated MoDA.
        calibration_ids: [B, T] token ids of representative text: scale each gate by its head's depth-to-sequence
            mass ratio (:func:`calibrate_depth_gates`), so that every gate trains at one learning rate. Recommended
            for continued training; without it the gates are raw factors (exact all the same).
        load_kwargs: passed to ``from_pretrained`` when a path is given.
    Returns:
        A ``MoDAForCausalLM`` (``norm_position="pre"``, as Llama) on the Llama's device and dtype, in
        eval mode if the Llama was.
    """
    if ffn_kv_init not in FFN_KV_INITS:
        raise ValueError(f"ffn_kv_init must be one of {FFN_KV_INITS}; got {ffn_kv_init!r}")
    if norm_position != "pre":
        raise ValueError(
            f"norm_position must be 'pre' for a Llama warm start (Llama is pre-norm); got {norm_position!r}"
        )
    llama = load_source(model_or_path, **load_kwargs)
    fields = source_config_fields(llama.config)
    if not isinstance(depth_gate, bool):
        raise ValueError(f"depth_gate must be a bool (True or False); got {depth_gate!r}")
    gate_fields = {"moda_depth_gate": True, "moda_depth_gate_init": 0.0} if depth_gate else {}
    config = MoDAConfig(**fields, moda_ffn_kv=moda_ffn_kv, norm_position="pre", **gate_fields)
    attn_implementation = llama.config._attn_implementation
    config._attn_implementation = attn_implementation if attn_implementation in ("eager", "sdpa") else "sdpa"
    model = MoDAForCausalLM(config)
    keep_llama_settings(llama, model)
    new_keys = tuple(f"model.layers.{i}.{name}" for i in range(config.num_hidden_layers)
                     for name in ("ffn_kv_proj.", "ffn_k_norm.", "self_attn.depth_gate"))  # (the gate's scale too)
    copy_llama_weights(llama, model, new_keys=new_keys)
    init_ffn_kv_from_llama(model, ffn_kv_init)
    if config.tie_word_embeddings:
        model.tie_weights()
    if calibration_ids is not None:
        if not depth_gate:
            raise ValueError("calibration_ids scale the depth gates: pass depth_gate=True with them")
        calibrate_depth_gates(model, calibration_ids)
    return model


__all__ = ["llama_to_denseformer", "load_source", "copy_llama_weights", "keep_llama_settings", "source_config_fields"]
__all__ += ["llama_to_moda", "init_ffn_kv_from_llama", "calibrate_depth_gates", "FFN_KV_INITS"]


def llama_to_attnres(
    model_or_path: LlamaForCausalLM | str | os.PathLike,
    attnres_block_size: int | None = None,
    **load_kwargs,
) -> torch.nn.Module:
    """Convert a ``LlamaForCausalLM`` (object, folder or Hub id) into an ``AttnResForCausalLM`` (full or block).

    Every Llama weight is copied under the same name; the pseudo-queries start at zero and the key norms
    at one (the paper's init), so every AttnRes call averages its sources uniformly. That average is the
    Llama's residual sum divided by the number of sources N, and each sub-layer (and the final norm) reads
    it through an RMSNorm, which undoes the scale *except for its eps*: sub-layer l computes the Llama's
    ``norm(sum)`` with ``eps`` replaced by ``N_l ** 2 * eps``. So the converted model is not exactly the
    Llama: the logits move, by an amount that shrinks with the hidden states' RMS against ``sqrt(eps) N``
    (docs/ATTNRES.md has measurements; with ``rms_norm_eps -> 0`` the logits agree to float rounding). A branch with
    no norm in front (OLMo 2's post-norm layers) would read the sum ``/ N`` itself: there its input projections
    (:data:`BRANCH_INPUT_PROJECTIONS`) are multiplied by ``N`` instead, which gives the source's sub-layer up to float
    rounding. Continue pre-training to learn the pseudo-queries.

    Args:
        model_or_path: the Llama model, or anything ``LlamaForCausalLM.from_pretrained`` accepts.
        attnres_block_size: None (full AttnRes) or S, ``1 <= S <= 2 * num_hidden_layers`` (block AttnRes).
        load_kwargs: passed to ``from_pretrained`` when a path is given.
    Returns:
        An ``AttnResForCausalLM`` on the Llama's device and dtype, in eval mode if the Llama was.
    """
    from .models.configuration_attnres import AttnResConfig
    from .models.modeling_attnres import AttnResForCausalLM

    llama = load_source(model_or_path, **load_kwargs)
    config = AttnResConfig(**source_config_fields(llama.config), attnres_block_size=attnres_block_size)
    config._attn_implementation = llama.config._attn_implementation
    model = AttnResForCausalLM(config)
    keep_llama_settings(llama, model)
    new_keys = tuple(f"model.layers.{i}.{name}." for i in range(config.num_hidden_layers)
                     for name in ("mlp_res", "output_res"))
    copy_llama_weights(llama, model, new_keys=new_keys)
    undo_uniform_average_scale(model)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


# The projections that read a decoder layer's branch input, by the branch's module (the backbones' shared names).
BRANCH_INPUT_PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


@torch.no_grad()
def undo_uniform_average_scale(model: torch.nn.Module) -> None:
    """In a freshly converted AttnRes, multiply the input projections of each branch that has no norm in front by the
    number N of sources its AttnRes call averages (uniform at conversion: the residual sum ``/ N``), so the branch
    computes the source's. Branches behind a norm are left as they are (the norm undoes the scale)."""
    sources = 1  # the embedding
    for layer in model.model.layers:
        for branch, norms_in, starts_block in (("self_attn", layer.shape.attention_in, layer.attn_starts_block),
                                               ("mlp", layer.shape.mlp_in, layer.mlp_starts_block)):
            if not norms_in and sources > 1:
                for name in BRANCH_INPUT_PROJECTIONS[branch]:
                    getattr(getattr(layer, branch), name).weight.mul_(sources)
            sources += starts_block


__all__ += ["llama_to_attnres"]


def llama_to_mhc(
    model_or_path: LlamaForCausalLM | str | os.PathLike,
    hc_mult: int = 4,
    hc_sinkhorn_iters: int = 20,
    hc_eps: float = 1e-6,
    post_spread: float = 0.5,
    **load_kwargs,
) -> torch.nn.Module:
    """Convert a ``LlamaForCausalLM`` (object, folder or Hub id) into an ``MHCForCausalLM`` with ``hc_mult`` streams.

    Every Llama weight is copied under the same name. The hyper-connections start as a plain residual
    (``models.modeling_mhc.init_as_residual``): ``fn = 0`` and ``scale = 1``, ``pre = 1/n`` (the head's too), a
    uniform ``comb`` (whose Sinkhorn result has all row sums equal to rho = 1 - O(eps)) and ``post`` spread around
    ``rho^(s+1)`` at sub-layer s over the streams (``post_spread``; the streams must differ for training to tell
    them apart). Then sub-layer s reads ``rho^s`` times the Llama's residual stream, which its pre-norm (and the
    final norm) reads back up to the norm's epsilon: in exact arithmetic the converted model computes the Llama's
    logits up to that epsilon, as close as the parametrisation allows (rho < 1 is forced by the Sinkhorn
    denominators' eps, and compensated by ``post``). What remains is float32 rounding (in a float64 model too: the
    float32 inside transformers' LlamaRMSNorm), and it grows with depth. Max |Δlogits| over the logits' scale
    (max |logits|): random tiny Llamas 6e-7 in float32, 1.7e-7 in float64 (1e-12 with float64 norms and
    rms_norm_eps -> 0; tests/mhc/test_remote_code_and_convert.py, docs/MHC.md), bound 2e-6; real weights
    (SmolLM2-135M-Instruct, float32): its first 2 layers 4.7e-7 (bound 2e-6, tests/recipes/
    test_upcycle_real_weights.py), all 30 layers 3.5e-6 to 5.9e-6 on held-out text (1.45e-4 to 1.9e-4 absolute;
    examples/upcycle_pretrained.py, docs/RESULTS.md): so about 2e-7 per layer, 1e-5 for a 30-layer model. Greedy
    text and perplexity (to 4 digits) are the Llama's. The hyper-connection parameters are float32 (float64 for a
    float64 Llama) whatever the Llama's dtype.

    Args:
        model_or_path: the Llama model, or anything ``LlamaForCausalLM.from_pretrained`` accepts.
        hc_mult: n >= 1, the number of streams.
        hc_sinkhorn_iters: >= 1. hc_eps: > 0 and < 1 / hc_mult.
        post_spread: in [0, 1), the relative spread of ``post`` over the streams (0: the streams stay equal).
        load_kwargs: passed to ``from_pretrained`` when a path is given.
    Returns:
        An ``MHCForCausalLM`` on the Llama's device and dtype, in eval mode if the Llama was.
    """
    from .models.configuration_mhc import MHCConfig
    from .models.modeling_mhc import MHCForCausalLM, MHCHyperConnection, MHCHyperHead, init_as_residual

    llama = load_source(model_or_path, **load_kwargs)
    config = MHCConfig(**source_config_fields(llama.config), hc_mult=hc_mult, hc_sinkhorn_iters=hc_sinkhorn_iters,
                       hc_eps=hc_eps)
    config._attn_implementation = llama.config._attn_implementation
    model = MHCForCausalLM(config)
    keep_llama_settings(llama, model)
    hc_dtype = torch.float64 if next(llama.parameters()).dtype == torch.float64 else torch.float32
    for module in model.modules():
        if isinstance(module, (MHCHyperConnection, MHCHyperHead)):
            module.to(hc_dtype)
    new_keys = tuple(f"model.layers.{i}.{name}." for i in range(config.num_hidden_layers)
                     for name in ("attn_hc", "ffn_hc")) + ("model.hc_head.",)
    copy_llama_weights(llama, model, new_keys=new_keys)
    init_as_residual(model, post_spread)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


__all__ += ["llama_to_mhc"]
__all__ += ["LOAD_OPTIONS", "check_float_weights"]
