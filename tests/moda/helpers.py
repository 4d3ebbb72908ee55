"""Tiny MoDA/Llama configs shared by the MoDA tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from depthfusion_hf import MoDAConfig, MoDAForCausalLM
from tests.causal_lm_checks import TINY_DECODER

TINY = {**TINY_DECODER, "num_hidden_layers": 4}


def tiny_config(**overrides) -> MoDAConfig:
    """A 4-layer MoDA config with GQA (4 query heads, 2 KV heads, d = 12), small enough for fast CPU tests."""
    return MoDAConfig(**{**TINY, **overrides})


def tiny_llama_config(**overrides) -> LlamaConfig:
    """The Llama config matching :func:`tiny_config`."""
    return LlamaConfig(**{**TINY, **overrides})


def tiny_model(seed: int = 0, **overrides) -> MoDAForCausalLM:
    """A seeded tiny MoDA model in eval mode, with weights scaled up so attention is far from uniform."""
    torch.manual_seed(seed)
    return sharpen_attention(MoDAForCausalLM(tiny_config(**overrides)).eval())


def sharpen_attention(model: MoDAForCausalLM) -> MoDAForCausalLM:
    """Scale the query, key and FFN-side K/V projections by 8, so that attention over the sequence and the depth
    entries is far from uniform (a wrong entry or mask then shows)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "ffn_kv_proj.weight")):
                param.mul_(8.0)
    return model
