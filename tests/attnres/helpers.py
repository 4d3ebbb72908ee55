"""Tiny AttnRes/Llama configs and a naive AttnRes loop shared by the AttnRes model tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from depthfusion_hf.models.configuration_attnres import AttnResConfig
from depthfusion_hf.models.modeling_attnres import AttnResForCausalLM
from tests.causal_lm_checks import TINY_DECODER

TINY = {**TINY_DECODER, "num_hidden_layers": 4}  # 8 sub-layers


def tiny_config(**overrides) -> AttnResConfig:
    """A 4-layer (8 sub-layer) AttnRes config with GQA, small enough for fast CPU tests (full AttnRes)."""
    return AttnResConfig(**{**TINY, **overrides})


def tiny_llama_config(**overrides) -> LlamaConfig:
    """The Llama config matching :func:`tiny_config`."""
    return LlamaConfig(**{**TINY, **overrides})


def randomise_attnres(model: AttnResForCausalLM, seed: int = 0) -> None:
    """Move every pseudo-query off zero and every key-norm weight off one, so that the softmax is far from uniform."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".query"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".key_norm_weight"):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))


def naive_mix(query: torch.Tensor, norm_weight: torch.Tensor, sources: list[torch.Tensor], eps: float):
    """PAPERS.md section 4 for one call, in float64: ``h = sum_i softmax_i(w . RMSNorm(s_i)) s_i``; (h, alpha)."""
    s = torch.stack([x.double() for x in sources], dim=-2)  # [B, T, N, D]
    keys = norm_weight.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    alpha = torch.softmax(keys @ query.double(), dim=-1)  # [B, T, N]
    return (alpha.unsqueeze(-1) * s).sum(-2), alpha


def naive_sources(outputs: list[torch.Tensor], block_size: int | None) -> list[torch.Tensor]:
    """What the next AttnRes call reads after sub-layers 1..l-1 wrote ``outputs = [v_0, .., v_{l-1}]``.

    Full: every v_i. Block (S): v_0, then the sum of each block's outputs so far, block n holding
    sub-layers (n-1)S+1 .. nS (a finished block's sum b_n, or the running sum of the current block).
    """
    if block_size is None:
        return list(outputs)
    sums: dict[int, torch.Tensor] = {}
    for sublayer, v in enumerate(outputs[1:], start=1):
        block = (sublayer - 1) // block_size
        sums[block] = sums[block] + v if block in sums else v
    return [outputs[0]] + [sums[n] for n in sorted(sums)]


def naive_attnres_forward(model: AttnResForCausalLM, input_ids: torch.Tensor):
    """The paper's loop over sub-layers, written independently of the model's forward (SDPA, causal, no padding).

    Returns (logits [B, T, V] float64-mixed then cast, the list of every call's alpha [B, T, N]).
    """
    inner, cfg = model.model, model.config
    x = inner.embed_tokens(input_ids)
    position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
    position_embeddings = inner.rotary_emb(x, position_ids=position_ids)
    calls = [mix for layer in inner.layers for mix in (layer.mlp_res, layer.output_res)]  # sub-layers 2..2L, final
    outputs = [x]  # v_0 = embedding
    alphas = []
    for sublayer in range(1, 2 * cfg.num_hidden_layers + 2):
        sources = naive_sources(outputs, cfg.attnres_block_size)
        if sublayer == 1:
            assert len(sources) == 1
            h = sources[0]
        else:
            mix = calls[sublayer - 2]
            h, alpha = naive_mix(mix.query, mix.key_norm_weight, sources, cfg.rms_norm_eps)
            h = h.to(x.dtype)
            alphas.append(alpha)
        if sublayer == 2 * cfg.num_hidden_layers + 1:
            break
        layer = inner.layers[(sublayer - 1) // 2]
        if sublayer % 2 == 1:
            v = layer.self_attn(hidden_states=layer.input_layernorm(h), attention_mask=None,
                                position_embeddings=position_embeddings, position_ids=position_ids)[0]
        else:
            v = layer.mlp(layer.post_attention_layernorm(h))
        outputs.append(v)
    return model.lm_head(inner.norm(h)), alphas


def set_small_numel(monkeypatch, value: int) -> None:
    """Move the torch backend's small-input threshold ``SMALL_NUMEL`` (e.g. -1: tiny test shapes take the forward
    over the list of sources, the one training sizes take, instead of the stacked one of cached decoding)."""
    from depthfusion_hf.models import attnres

    monkeypatch.setattr(attnres, "SMALL_NUMEL", value)
