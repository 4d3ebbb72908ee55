#!/usr/bin/env python
"""Upcycle a Llama into a DenseFormer and into a MoDA model, then continue training both.

    python examples/llama_upcycling.py     # under a minute on CPU

1. A small Llama is trained briefly on the King James Bible and saved (stand-in for any Llama checkpoint:
   ``llama_to_denseformer`` / ``llama_to_moda`` take a model, a folder or a Hub id).
2. ``llama_to_denseformer`` copies every weight and starts the DWA weights at the identity, so the
   DenseFormer's logits equal the Llama's.
3. ``llama_to_moda`` copies every weight too, but MoDA's softmax also covers each token's depth K/V from
   earlier layers from the start, so its logits move (how much is printed) and training must continue.
4. A few training steps on each: the losses go down, and the DenseFormer's DWA weights leave the identity.
"""

from __future__ import annotations

import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

from depthfusion_hf.convert import llama_to_denseformer, llama_to_moda
from depthfusion_hf.data.corpus import load_kjv_chapters, pack_into_blocks, train_bpe_tokenizer


def train(model, blocks: torch.Tensor, steps: int, lr: float = 3e-3, batch_size: int = 8, seed: int = 0) -> list[float]:
    """``steps`` AdamW steps on random batches of ``blocks`` [N, T]; returns the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(steps):
        batch = blocks[torch.randint(0, len(blocks), (batch_size,), generator=generator)]  # [B, T]
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def compare(name: str, model, llama, batch: torch.Tensor) -> float:
    """Print max |Δlogits|, KL(Llama || model) per token and greedy top-1 agreement; return max |Δlogits|."""
    ours, ref = model(batch).logits, llama(batch).logits  # [B, T, V]
    diff = (ours - ref).abs().max().item()
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"  {name:<28} max |Δlogits| {diff:.2e}   KL(Llama‖model) {kl:.2e}   top-1 agreement {agree:.1%}")
    return diff


def main() -> None:
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast and shares a busy CPU better
    torch.manual_seed(0)
    start = time.perf_counter()
    chapters = load_kjv_chapters()[:80]
    tokenizer = train_bpe_tokenizer(chapters[:-8], vocab_size=512)
    train_blocks = torch.tensor(pack_into_blocks(tokenizer, chapters[:-8], 48, max_blocks=400)["input_ids"])
    val_blocks = torch.tensor(pack_into_blocks(tokenizer, chapters[-8:], 48, max_blocks=16)["input_ids"])

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    llama = LlamaForCausalLM(config)
    train(llama, train_blocks, steps=60)
    with tempfile.TemporaryDirectory() as folder:
        llama.save_pretrained(folder)  # upcycling reads any Llama checkpoint folder or Hub id
        dense = llama_to_denseformer(folder, dwa_dilation=2, dwa_period=2).eval()
        moda = llama_to_moda(folder, moda_ffn_kv=True, ffn_kv_init="zero").eval()

    def val_loss(model) -> float:
        with torch.no_grad():
            return model(val_blocks, labels=val_blocks).loss.item()

    print("at conversion (held-out chapters):")
    assert compare("Llama -> DenseFormer 2x2", dense, llama, val_blocks) <= 1e-4  # identical up to rounding
    compare("Llama -> MoDA (FFN KV = 0)", moda, llama, val_blocks)
    print(f"  validation loss: Llama {val_loss(llama):.3f}, DenseFormer {val_loss(dense):.3f}, "
          f"MoDA {val_loss(moda):.3f}")

    steps = 30
    print(f"\ncontinued training, {steps} steps each (the Llama too, for a fair comparison):")
    for name, model in (("Llama", llama), ("DenseFormer 2x2", dense), ("MoDA", moda)):
        losses = train(model, train_blocks, steps=steps, seed=1)
        print(f"  {name:<16} train loss {losses[0]:.3f} -> {losses[-1]:.3f}   validation loss {val_loss(model):.3f}")
    identity = dense.model.dwa.identity_alphas().to(dense.model.dwa.alphas.dtype)
    moved = (dense.model.dwa.alphas.detach() - identity).abs().max().item()
    print(f"\nDenseFormer DWA weights moved from the identity by up to {moved:.3f}; the learned matrix:")
    print(dense.dwa_weights().numpy().round(2))
    print(f"\ndone in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
