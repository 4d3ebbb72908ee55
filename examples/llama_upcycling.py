#!/usr/bin/env python
"""Upcycle a Llama into every depth-fusion family, continue training each, and look at what the new weights learn.

    python examples/llama_upcycling.py                       # about two minutes on CPU
    python examples/llama_upcycling.py --new_param_lr_scale 1 --output_dir outputs/my_run   # every family at 1x

1. A small Llama is trained briefly on the King James Bible and saved (stand-in for any Llama checkpoint: every
   family's ``from_llama`` in ``depthfusion_hf.families.FAMILIES`` takes a model, a folder or a Hub id).
2. Each family upcycles it, copying every Llama weight:
   - DenseFormer starts its DWA weights at the identity: its logits equal the Llama's.
   - MoDA's softmax also covers each token's depth K/V from earlier layers from the start, so its logits move.
   - AttnRes starts its pseudo-queries at zero, so every call averages its sources; the pre-norms undo that
     average's scale except for their epsilon, so the logits move a little.
3. A few training steps on the Llama and on each upcycled model. The parameters the Llama lacks (found with
   ``new_parameter_names``) train at their family's recommended multiple of the learning rate (10x DenseFormer
   and MoDA, 1x AttnRes and mHC: the upcycling study in ``docs/RESULTS.md``; ``--new_param_lr_scale`` overrides it), as
   ``scripts/train_clm.py --init_from LLAMA --new_param_lr_scale S`` does.
4. What the new weights learned: the DenseFormer's DWA matrix, and block AttnRes's depth attention (each call's
   softmax over its sources, averaged over held-out tokens), drawn to ``<output_dir>/depth_weights.png``; the
   AttnRes model is saved to ``<output_dir>/model``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

from depthfusion_hf.data.corpus import load_kjv_chapters, pack_into_blocks, train_bpe_tokenizer
from depthfusion_hf.families import FAMILIES, causal_lm_families
from depthfusion_hf.plotting_attnres import depth_attention_labels, plot_depth_attention_heatmap
from depthfusion_hf.recipes.clm import new_parameter_names, recommended_new_param_lr_scale

# The variant each family is upcycled to here (a family added later upcycles with its defaults).
UPCYCLE_OPTIONS = {
    "denseformer": {"dwa_dilation": 2, "dwa_period": 2},
    "moda": {"moda_ffn_kv": True, "ffn_kv_init": "zero"},
    "attnres": {"attnres_block_size": 4},
}


def train(model, blocks: torch.Tensor, steps: int, lr: float = 3e-3, new_param_lr_scale: float = 1.0,
          batch_size: int = 8, seed: int = 0) -> list[float]:
    """``steps`` AdamW steps on random batches of ``blocks`` [N, T], the parameters a Llama lacks at
    ``new_param_lr_scale`` x ``lr``; returns the loss of every step."""
    new = set(new_parameter_names(model))  # a Llama lacks nothing of its own: one group
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n not in new], "lr": lr},
              {"params": [p for n, p in named if n in new], "lr": lr * new_param_lr_scale}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=0.0)
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
    print(f"  Llama -> {name:<16} max |Δlogits| {diff:.2e}   KL(Llama‖model) {kl:.2e}   top-1 agreement {agree:.1%}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="outputs/llama_upcycling", help="where the plot and model go")
    parser.add_argument("--steps", type=int, default=30, help="continued-training steps per model")
    parser.add_argument("--new_param_lr_scale", type=float, default=None,
                        help="learning-rate multiplier of the parameters the Llama lacks, for every family "
                             "(default: each family's scale from the upcycling study)")
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
    families = [FAMILIES[kind] for kind in causal_lm_families() if FAMILIES[kind].from_llama is not None]
    with tempfile.TemporaryDirectory() as folder:
        llama.save_pretrained(folder)  # upcycling reads any Llama checkpoint folder or Hub id
        models = {}
        for family in families:
            model = family.from_llama(folder, **UPCYCLE_OPTIONS.get(family.model_type, {})).eval()
            models[family.variant_name(model.config)] = model

    def val_loss(model) -> float:
        with torch.no_grad():
            return model(val_blocks, labels=val_blocks).loss.item()

    print("at conversion (held-out chapters):")
    for name, model in models.items():
        compare(name, model, llama, val_blocks)
    print("  validation loss: " + ", ".join(f"{name} {val_loss(m):.3f}" for name, m in
                                             {"Llama": llama, **models}.items()))

    print(f"\ncontinued training, {args.steps} steps each (the Llama too, for a fair comparison):")
    for name, model in {"Llama": llama, **models}.items():
        kind = model.config.model_type
        scale = args.new_param_lr_scale
        scale = recommended_new_param_lr_scale(kind, model.config) if scale is None else scale
        losses = train(model, train_blocks, steps=args.steps, new_param_lr_scale=scale, seed=1)
        rate = "" if kind == "llama" else f"   (new parameters at {scale:g}x the rate)"
        print(f"  {name:<28} train loss {losses[0]:.3f} -> {losses[-1]:.3f}   validation loss {val_loss(model):.3f}"
              + rate)

    by_type = {model.config.model_type: model for model in models.values()}
    dense = by_type.get("denseformer")
    if dense is not None:
        identity = dense.model.dwa.identity_alphas().to(dense.model.dwa.alphas.dtype)
        moved = (dense.model.dwa.alphas.detach() - identity).abs().max().item()
        print(f"\nDenseFormer DWA weights moved from the identity by up to {moved:.3f}; the learned matrix:")
        print(dense.dwa_weights().numpy().round(2))
    attnres = by_type.get("attnres")
    if attnres is not None:
        block = attnres.config.attnres_block_size
        weights = attnres.depth_attention_weights(val_blocks)  # [2L + 1, N + 1], averaged over held-out tokens
        rows, cols = depth_attention_labels(config.num_hidden_layers, block)
        moved = max(layer.output_res.query.abs().max().item() for layer in attnres.model.layers)
        print(f"\nblock AttnRes depth attention after training (pseudo-queries moved from 0 by up to {moved:.3f}):")
        print("  " + " " * 8 + "".join(f"{c:>7}" for c in cols))
        for row, label in zip(weights.tolist(), rows):
            print(f"  {label:<8}" + "".join(f"{v:7.2f}" if v else f"{'':>7}" for v in row))
        figure = plot_depth_attention_heatmap(weights, out / "depth_weights.png", config.num_hidden_layers, block,
                                              title=f"AttnRes block {block} after upcycling + training")
        attnres.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
        print(f"\nheatmap: {figure}\nmodel: {out / 'model'}")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
