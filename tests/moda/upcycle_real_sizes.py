"""MoDA upcycled (closed depth gates) from randomly initialised backbones of real layer sizes: ``max |Δlogits| /
max |logits|`` against the source, per backbone (docs/MODA.md, "Backbones"). Two layers each, the published
checkpoint's per-layer sizes, vocabulary, RoPE base and norm eps.

    OMP_NUM_THREADS=2 python -m tests.moda.upcycle_real_sizes [--seeds 3]

prints, per source, the worst ratio over the seeds.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

import depthfusion_hf

COMMON = dict(num_hidden_layers=2, max_position_embeddings=4096)
SOURCES = {
    "Qwen3-0.6B": lambda: Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                      intermediate_size=3072, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                                      tie_word_embeddings=True, **COMMON),
    "Qwen2.5-0.5B": lambda: Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                        intermediate_size=4864, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                                        tie_word_embeddings=True, **COMMON),
    "Mistral-7B": lambda: MistralConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                        intermediate_size=14336, vocab_size=32000, rope_theta=1e4, rms_norm_eps=1e-5,
                                        sliding_window=4096, **COMMON),
    # the same sizes with a window the 64-token input exceeds, so that the sliding mask is exercised
    "Mistral-7B, window 16": lambda: MistralConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                                   intermediate_size=14336, vocab_size=32000, rope_theta=1e4,
                                                   rms_norm_eps=1e-5, sliding_window=16, **COMMON),
}


def measure(name: str, seed: int = 0, tokens: int = 64) -> float:
    torch.manual_seed(seed)
    source = AutoModelForCausalLM.from_config(SOURCES[name]()).eval()
    model = depthfusion_hf.upcycle(source, "moda").eval()
    input_ids = torch.randint(0, source.config.vocab_size, (2, tokens))
    with torch.no_grad():
        expected, found = source(input_ids).logits, model(input_ids).logits
    return ((found - expected).abs().max() / expected.abs().max()).item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1)
    seeds = parser.parse_args().seeds
    for name in SOURCES:
        print(f"| {name} | {max(measure(name, seed) for seed in range(seeds)):.2e} |", flush=True)
