"""Parameter and FLOP counts: exact against the real models, and against the paper's Table 3."""

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaForCausalLM

from depthfusion_hf import MoDAConfig, MoDAForCausalLM

from .helpers import tiny_config, tiny_llama_config
from .moda_cost import compare_with_baseline, moda_cost

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("ffn_kv", [True, False])
@pytest.mark.parametrize("tied", [True, False])
def test_counts_match_the_real_models(ffn_kv, tied):
    seq_len = 10
    config = tiny_config(moda_ffn_kv=ffn_kv, tie_word_embeddings=tied)
    cost = compare_with_baseline(config, seq_len)
    baseline = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=tied))
    models = {"moda": MoDAForCausalLM(config), "baseline": baseline}
    ids = torch.randint(3, 97, (1, seq_len))
    for key, model in models.items():
        model.set_attn_implementation("eager")  # full T x T matmuls, the counter's (and the paper's) convention
        assert cost[key].params == sum(p.numel() for p in model.parameters()), key
        counter, rotary = FlopCounterMode(display=False), FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(ids)
        with rotary, torch.no_grad():  # the RoPE tables: a matmul in transformers < 5.2x, outside the cost model
            model.model.rotary_emb(model.model.embed_tokens(ids), torch.arange(seq_len).unsqueeze(0))
        # The depth pool's weighted sum of values is a multiply-add per entry, not a matmul the counter sees: the
        # counted FLOPs are the model's minus exactly those, 2 Hq d per depth entry and token.
        mix = 2 * config.num_attention_heads * config.head_dim * cost[key].depth_entries_per_token * seq_len
        counted = counter.get_total_flops() - rotary.get_total_flops()
        assert counted == cost[key].flops_per_sequence - (mix if key == "moda" else 0), key


def test_700m_config_matches_table_3():
    fields = json.loads((CONFIGS / "moda_700m.json").read_text())
    config = MoDAConfig(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")})
    assert (config.num_hidden_layers, config.hidden_size) == (36, 1024)
    assert config.num_attention_heads // config.num_key_value_heads == 2
    table = compare_with_baseline(config, seq_len=4096, nonmatmul=True)
    base, ours = table["baseline"], table["moda"]
    # Table 3: 669.0M -> 705.7M parameters (ours include the 74,752 RMSNorm weights), 8.01T -> 8.33T FLOPs.
    assert round((base.params - 74_752) / 1e6, 1) == 669.0 and round((ours.params - 74_752) / 1e6, 1) == 705.7
    assert round(base.flops_per_sequence / 1e12, 2) == 8.01 and round(ours.flops_per_sequence / 1e12, 2) == 8.33
    deeper = moda_cost(MoDAConfig(**{**config.to_dict(), "num_hidden_layers": 38}), 4096, moda=False, nonmatmul=True)
    assert round(deeper.params / 1e6, 1) == 700.5 and round(deeper.flops_per_sequence / 1e12, 2) == 8.41
    depth_only = moda_cost(MoDAConfig(**{**config.to_dict(), "moda_ffn_kv": False}), 4096, nonmatmul=True)
    assert depth_only.params == base.params and round(depth_only.flops_per_sequence / 1e12, 2) == 8.02


def test_tiny_config_file_builds():
    fields = json.loads((CONFIGS / "moda_tiny.json").read_text())
    model = MoDAForCausalLM(MoDAConfig(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")}))
    assert model.config.num_hidden_layers == 6


def test_bad_seq_len_raises():
    with pytest.raises(ValueError, match="seq_len"):
        moda_cost(tiny_config(), 0)
