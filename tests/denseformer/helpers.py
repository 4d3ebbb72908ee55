"""Tiny DenseFormer/Llama configs shared by the DenseFormer tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM

TINY = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(**overrides) -> DenseFormerConfig:
    """A 6-block DenseFormer config with GQA, small enough for fast CPU tests."""
    return DenseFormerConfig(**{**TINY, **overrides})


def tiny_llama_config(**overrides) -> LlamaConfig:
    """The Llama config matching :func:`tiny_config`."""
    return LlamaConfig(**{**TINY, **overrides})


def randomise_dwa(model: DenseFormerForCausalLM, seed: int = 0) -> None:
    """Move the DWA weights away from the identity so that tests exercise the mixing."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        alphas = model.model.dwa.alphas
        alphas.add_(0.3 * torch.randn(alphas.shape, generator=generator))
