#!/usr/bin/env python
"""Quickstart: build a tiny DenseFormer through the Auto classes, run it, save it, load it back.

    python examples/quickstart.py          # a few seconds on CPU

Steps: a 4×2 DenseFormer config -> ``AutoModelForCausalLM.from_config`` -> forward pass with a loss ->
the learned DWA weights -> ``save_pretrained`` / ``from_pretrained`` (identical logits) -> a remote-code
folder that loads with ``trust_remote_code=True`` where depthfusion-hf is not installed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.utils import logging

import depthfusion_hf  # noqa: F401  (registers "denseformer", "moda" and "dwatt" with the Auto classes)
from depthfusion_hf.export import check_export_folder, save_remote_code_folder


def main() -> None:
    logging.set_verbosity_error()  # quiet the load reports (AutoModel drops the LM head: expected)
    logging.disable_progress_bar()
    torch.manual_seed(0)
    # 8 Llama blocks of width 64; a DWA step after every 2nd block over the outputs j = i (mod 4): "4x2"
    config = AutoConfig.for_model(
        "denseformer", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, dwa_dilation=4, dwa_period=2,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{model.model.dwa.alphas.numel()} of them DWA weights")

    input_ids = torch.randint(0, config.vocab_size, (2, 16))  # [B, T]
    with torch.no_grad():
        out = model(input_ids, labels=input_ids)
    print(f"logits {tuple(out.logits.shape)}, loss {out.loss.item():.3f} (uniform guess: ln 256 = 5.545)")

    # the DWA weights start as the identity: each DWA step passes the current block's output through,
    # so at initialisation a DenseFormer is exactly the plain transformer
    weights = model.dwa_weights()  # [num_layers, num_layers + 1], row i-1 = DWA step after block i
    print(f"DWA weight matrix {tuple(weights.shape)}; row of block 4 at init: {weights[3].tolist()}")

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp).eval()
        with torch.no_grad():
            diff = (reloaded(input_ids).logits - out.logits).abs().max().item()
        print(f"save_pretrained -> from_pretrained ({type(reloaded).__name__}): max |Δlogits| = {diff:.1e}")
        assert diff == 0.0

        base = AutoModel.from_pretrained(tmp)  # the base model: last hidden state instead of logits
        with torch.no_grad():
            hidden = base(input_ids).last_hidden_state
        print(f"AutoModel -> {type(base).__name__}: last_hidden_state {tuple(hidden.shape)}")

        folder = save_remote_code_folder(model, Path(tmp) / "remote-code")
        assert check_export_folder(folder) == []
        print(f"remote-code folder: {sorted(p.name for p in folder.iterdir())}")
        print("  load it anywhere with AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)")


if __name__ == "__main__":
    main()
