"""Tiny models of the families for the training / PEFT / parallelism tests."""

from __future__ import annotations

import torch
from transformers import BertConfig

import depthfusion_hf

DECODER = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def tiny_denseformer(seed: int = 0, **overrides) -> depthfusion_hf.DenseFormerForCausalLM:
    """A 4-block width-64 DenseFormer (1×1 by default) with random, non-identity DWA weights."""
    torch.manual_seed(seed)
    config = depthfusion_hf.DenseFormerConfig(**(DECODER | {"dwa_dilation": 1, "dwa_period": 1} | overrides))
    model = depthfusion_hf.DenseFormerForCausalLM(config).eval()
    with torch.no_grad():  # move off the identity so a wrong DWA path changes the logits
        model.model.dwa.alphas.add_(0.1 * torch.randn_like(model.model.dwa.alphas))
    return model


def tiny_moda(seed: int = 0, **overrides) -> depthfusion_hf.MoDAForCausalLM:
    """A 4-block width-64 MoDA with the FFN-side depth K/V projection."""
    torch.manual_seed(seed)
    config = depthfusion_hf.MoDAConfig(**(DECODER | {"moda_ffn_kv": True} | overrides))
    return depthfusion_hf.MoDAForCausalLM(config).eval()


def tiny_dwatt(seed: int = 0, fusion: str = "dwatt") -> depthfusion_hf.DWAttForTokenClassification:
    """A 2-layer width-32 BERT encoder with a DWAtt fusion head and a 5-label classifier."""
    torch.manual_seed(seed)
    backbone = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          vocab_size=100, max_position_embeddings=64, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    config = depthfusion_hf.DWAttConfig(backbone_config=backbone, fusion=fusion, num_labels=5, classifier_dropout=0.0)
    return depthfusion_hf.DWAttForTokenClassification(config).eval()


def token_batch(vocab_size: int = 100, batch: int = 2, tokens: int = 12, seed: int = 1) -> torch.Tensor:
    """Random token ids [batch, tokens]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, tokens), generator=generator)


def tiny_attnres(seed: int = 0, **overrides) -> depthfusion_hf.AttnResForCausalLM:
    """A 4-block width-64 block AttnRes (S = 3) with pseudo-queries off zero and key-norm weights off one."""
    torch.manual_seed(seed)
    model = depthfusion_hf.AttnResForCausalLM(depthfusion_hf.AttnResConfig(**(DECODER | {"attnres_block_size": 3}
                                                                             | overrides))).eval()
    with torch.no_grad():  # a far-from-uniform softmax, so that a wrong path changes the logits
        for name, param in model.named_parameters():
            if name.endswith(".query"):
                param.normal_(0.0, 0.5)
            elif name.endswith(".key_norm_weight"):
                param.add_(0.3 * torch.randn_like(param))
    return model


def tiny_mhc(seed: int = 0, **overrides) -> depthfusion_hf.MHCForCausalLM:
    """A 4-block width-64 mHC (n = 4 streams) with fn, base and scale off their init (pre, post, comb far from
    uniform)."""
    torch.manual_seed(seed)
    model = depthfusion_hf.MHCForCausalLM(depthfusion_hf.MHCConfig(**(DECODER | {"hc_mult": 4} | overrides))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".fn", ".hc_fn")):
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
            elif name.endswith((".base", ".hc_base")):
                param.normal_()
            elif name.endswith((".scale", ".hc_scale")):
                param.add_(0.3 * torch.randn_like(param))
    return model
