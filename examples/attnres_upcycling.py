#!/usr/bin/env python
"""Upcycle a Llama into Attention Residuals (full and block), continue training, look at the depth attention.

    python examples/attnres_upcycling.py                     # about a minute on CPU
    python examples/attnres_upcycling.py --output_dir outputs/my_run

1. A small Llama is trained briefly on the King James Bible and saved (stand-in for any Llama checkpoint:
   ``llama_to_attnres`` takes a model, a folder or a Hub id).
2. ``llama_to_attnres`` copies every weight; the pseudo-queries start at zero, so every AttnRes call averages
   its sources. That average is the Llama's residual sum divided by the number of sources, and the pre-norms
   undo the scale except for their epsilon: the logits move a little (printed), and with a near-zero
   ``rms_norm_eps`` they would not move at all.
3. A few training steps on the Llama and on block AttnRes (blocks of 4 sub-layers): the pseudo-queries learn
   a content-dependent mix.
4. The learned depth attention (each call's softmax over its sources, averaged over held-out tokens) is
   printed and drawn to ``<output_dir>/depth_weights.png``; the model is saved to ``<output_dir>/model``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

from depthfusion_hf.convert import llama_to_attnres
from depthfusion_hf.data.corpus import load_kjv_chapters, pack_into_blocks, train_bpe_tokenizer
from depthfusion_hf.plotting_attnres import depth_attention_labels, plot_depth_attention_heatmap


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
def compare(name: str, model, llama, batch: torch.Tensor) -> None:
    """Print max |Δlogits|, KL(Llama || model) per token and greedy top-1 agreement against the Llama."""
    ours, ref = model(batch).logits, llama(batch).logits  # [B, T, V]
    diff = (ours - ref).abs().max().item()
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"  {name:<30} max |Δlogits| {diff:.2e} (logits up to {ref.abs().max().item():.1f})   "
          f"KL(Llama‖model) {kl:.2e}   top-1 agreement {agree:.1%}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="outputs/attnres_upcycling", help="where the plot and model go")
    parser.add_argument("--steps", type=int, default=40, help="continued-training steps per model")
    args = parser.parse_args(argv)
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast and shares a busy CPU better
    torch.manual_seed(0)
    start = time.perf_counter()
    out = Path(args.output_dir)
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
        full = llama_to_attnres(folder).eval()
        block = llama_to_attnres(folder, attnres_block_size=4).eval()

    def val_loss(model) -> float:
        with torch.no_grad():
            return model(val_blocks, labels=val_blocks).loss.item()

    print("at conversion (held-out chapters; the shift comes from the pre-norms' eps alone):")
    compare("Llama -> AttnRes full", full, llama, val_blocks)
    compare("Llama -> AttnRes block 4", block, llama, val_blocks)
    print(f"  validation loss: Llama {val_loss(llama):.3f}, AttnRes full {val_loss(full):.3f}, "
          f"AttnRes block 4 {val_loss(block):.3f}")

    print(f"\ncontinued training, {args.steps} steps each (the Llama too, for a fair comparison):")
    for name, model in (("Llama", llama), ("AttnRes block 4", block)):
        losses = train(model, train_blocks, steps=args.steps, seed=1)
        print(f"  {name:<16} train loss {losses[0]:.3f} -> {losses[-1]:.3f}   validation loss {val_loss(model):.3f}")

    weights = block.depth_attention_weights(val_blocks)  # [2L + 1, N + 1], averaged over held-out tokens
    rows, cols = depth_attention_labels(config.num_hidden_layers, 4)
    moved = max(layer.output_res.query.abs().max().item() for layer in block.model.layers)
    print(f"\nblock AttnRes depth attention after training (pseudo-queries moved from 0 by up to {moved:.3f}):")
    print("  " + " " * 8 + "".join(f"{c:>7}" for c in cols))
    for row, label in zip(weights.tolist(), rows):
        print(f"  {label:<8}" + "".join(f"{v:7.2f}" if v else f"{'':>7}" for v in row))
    figure = plot_depth_attention_heatmap(weights, out / "depth_weights.png", config.num_hidden_layers, 4,
                                          title="AttnRes block 4 after upcycling + training")
    block.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    print(f"\nheatmap: {figure}\nmodel: {out / 'model'}\ndone in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
