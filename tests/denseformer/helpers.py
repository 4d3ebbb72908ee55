"""Tiny DenseFormer/Llama configs shared by the DenseFormer tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM
from tests.causal_lm_checks import TINY_DECODER

TINY = {**TINY_DECODER, "num_hidden_layers": 6}


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
