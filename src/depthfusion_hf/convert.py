"""Upcycle Llama checkpoints into depth-fusion models.

A DenseFormer is a Llama whose layer loop has DWA steps in it, and all its Llama weights keep their
names, so conversion copies the state dict; the DWA weights start as the identity, which makes the
converted model's logits equal the Llama's.
"""

from __future__ import annotations

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .models.denseformer import DenseFormerConfig, DenseFormerForCausalLM


def load_llama(model_or_path: LlamaForCausalLM | str | os.PathLike, **load_kwargs) -> LlamaForCausalLM:
    """Return a ``LlamaForCausalLM``: the object itself, or loaded from a folder / Hub id."""
    if isinstance(model_or_path, LlamaForCausalLM):
        return model_or_path
    if isinstance(model_or_path, torch.nn.Module):
        raise ValueError(f"expected a LlamaForCausalLM or a path; got {type(model_or_path).__name__}")
    return LlamaForCausalLM.from_pretrained(model_or_path, **load_kwargs)


def llama_config_fields(config: LlamaConfig) -> dict:
    """The Llama config as a dict without ``model_type``/``architectures``/transformers bookkeeping."""
    fields = config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "auto_map", "_name_or_path"):
        fields.pop(key, None)
    return fields


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
    llama = load_llama(model_or_path, **load_kwargs)
    fields = llama_config_fields(llama.config)
    config = DenseFormerConfig(**fields, dwa_dilation=dwa_dilation, dwa_period=dwa_period)
    config._attn_implementation = llama.config._attn_implementation
    parameter = next(llama.parameters())
    model = DenseFormerForCausalLM(config).to(device=parameter.device, dtype=parameter.dtype)
    copy_llama_weights(llama, model, new_keys=("model.dwa.",))
    if config.tie_word_embeddings:
        model.tie_weights()
    model.train(llama.training)
    return model


__all__ = ["llama_to_denseformer", "load_llama", "copy_llama_weights", "llama_config_fields"]
