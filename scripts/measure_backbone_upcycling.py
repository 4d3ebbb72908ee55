#!/usr/bin/env python
"""Upcycling bounds per backbone at real layer sizes (issue 30): each supported backbone's causal LM, randomly
initialised with the per-layer sizes of its smallest published checkpoint (2 layers, vocabulary 512), upcycled into
DenseFormer, mHC and AttnRes (and MoDA with its depth gate closed where the backbone supports it); prints
max |Δlogits| and max |Δlogits| / max |logits| on a [2, 16] batch of random tokens. docs/ARCHITECTURE.md
("Backbones") has its output.

    python scripts/measure_backbone_upcycling.py [--families denseformer,mhc,attnres] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

import depthfusion_hf

COMMON = dict(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_hidden_layers=2)
REAL_SIZES = {  # the checkpoint whose per-layer sizes each backbone gets
    "llama": ("SmolLM2-135M", dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                   num_key_value_heads=3)),
    "mistral": ("Mistral-7B", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                   num_key_value_heads=8, sliding_window=None)),
    "qwen2": ("Qwen2.5-0.5B", dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                                   num_key_value_heads=2)),
    "qwen3": ("Qwen3-0.6B", dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128)),
    "phi3": ("Phi-3-mini", dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                                num_key_value_heads=32)),
    "gemma3_text": ("Gemma-3-270M", dict(hidden_size=640, intermediate_size=2048, num_attention_heads=4,
                                         num_key_value_heads=1, head_dim=256, sliding_window=512,
                                         layer_types=["sliding_attention", "full_attention"])),
    "olmo2": ("OLMo-2-1B", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                                num_key_value_heads=16)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="denseformer,mhc,attnres")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    families = args.families.split(",")
    print("| backbone (sizes of) | family | max abs Δlogits | relative |")
    print("|---|---|---|---|")
    for backbone, (checkpoint, sizes) in REAL_SIZES.items():
        torch.manual_seed(args.seed)
        source = AutoModelForCausalLM.from_config(CONFIG_MAPPING[backbone](**sizes, **COMMON)).eval()
        input_ids = torch.randint(3, COMMON["vocab_size"], (2, 16))
        with torch.no_grad():
            expected = source(input_ids).logits
        for family in families:
            options = {"depth_gate": True} if family == "moda" else {}
            try:
                model = depthfusion_hf.upcycle(source, family, **options).eval()
            except ValueError as error:
                print(f"| {backbone} ({checkpoint}) | {family} | refused: {error} | |")
                continue
            with torch.no_grad():
                difference = (model(input_ids).logits - expected).abs().max().item()
            print(f"| {backbone} ({checkpoint}) | {family} | {difference:.2e} | "
                  f"{difference / expected.abs().max().item():.2e} |", flush=True)


if __name__ == "__main__":
    main()
