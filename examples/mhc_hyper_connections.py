#!/usr/bin/env python
"""Manifold-constrained Hyper-Connections (mHC, DeepSeek-V4's residual) as a Hugging Face model: train one, look at
its learned stream mixing, upcycle a Llama into one, generate, export.

    python examples/mhc_hyper_connections.py                   # about a minute on CPU
    python examples/mhc_hyper_connections.py --hc_mult 2 --steps 100 --output_dir outputs/my_mhc

1. A 4-layer mHC decoder with ``hc_mult`` residual streams and the same-shape Llama train side by side for a few
   AdamW steps on the King James Bible (``scripts/train_clm.py --model mhc --hc_mult 4`` is the full job).
2. The residual is ``hc_mult`` streams per token (``output_hidden_states`` shows them); every attention and MLP reads
   them collapsed by ``pre`` and writes its output spread by ``post`` onto the streams mixed by ``comb``, which
   Sinkhorn-Knopp iterations keep (nearly) doubly stochastic: its columns and rows sum to 1.
3. The learned ``pre`` / ``post`` / ``comb`` of every sub-layer, averaged over held-out tokens, drawn to
   ``<output_dir>/mhc_weights.png`` (the main job's analysis plot).
4. ``llama_to_mhc`` upcycles the Llama: its hyper-connections start as a plain residual, so the converted model
   gives the Llama's logits (up to rounding).
5. Greedy generation with and without the KV cache, and the model exported as remote code and loaded back with
   ``trust_remote_code=True`` (the folder holds the model's code: no depthfusion-hf needed to load it).
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

from depthfusion_hf import MHCConfig, MHCForCausalLM
from depthfusion_hf.convert import llama_to_mhc
from depthfusion_hf.data.corpus import load_kjv_chapters, pack_into_blocks, train_bpe_tokenizer
from depthfusion_hf.export import save_remote_code_folder
from depthfusion_hf.plotting_mhc import plot_mhc_analysis


def train(model, blocks: torch.Tensor, steps: int, lr: float = 3e-3, batch_size: int = 8) -> list[float]:
    """``steps`` AdamW steps on random batches of ``blocks`` [N, T]; the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="outputs/mhc_example", help="where the figure goes")
    parser.add_argument("--hc_mult", type=int, default=4, help="residual streams n")
    parser.add_argument("--steps", type=int, default=40, help="training steps of each model")
    args = parser.parse_args(argv)
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast and shares a busy CPU better
    torch.manual_seed(0)
    start = time.perf_counter()
    chapters = load_kjv_chapters()[:60]
    tokenizer = train_bpe_tokenizer(chapters[:-6], vocab_size=512)
    train_blocks = torch.tensor(pack_into_blocks(tokenizer, chapters[:-6], 48, max_blocks=300)["input_ids"])
    val_blocks = torch.tensor(pack_into_blocks(tokenizer, chapters[-6:], 48, max_blocks=16)["input_ids"])
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)

    # 1. mHC and the same-shape Llama, side by side
    mhc = MHCForCausalLM(MHCConfig(**shape, hc_mult=args.hc_mult))
    llama = LlamaForCausalLM(LlamaConfig(**shape))
    name = f"mHC n{args.hc_mult}"
    for label, model in ((name, mhc), ("Llama", llama)):
        losses = train(model, train_blocks, args.steps)
        with torch.no_grad():
            val = model(val_blocks, labels=val_blocks).loss.item()
        params = sum(p.numel() for p in model.parameters())
        print(f"[{label}] {params:,} parameters, train loss {losses[0]:.2f} -> {losses[-1]:.2f}, "
              f"validation loss {val:.3f}")

    # 2. the streams and the constraint on comb
    sample = val_blocks[:1]
    with torch.no_grad():
        streams = mhc(sample, output_hidden_states=True).hidden_states
    print(f"{name}: streams {list(streams[1].shape)} per layer (batch, tokens, streams, width); the last hidden state "
          f"{list(streams[-1].shape)} is the head's collapse, normalised")
    weights = mhc.hyper_connection_weights(val_blocks[:4])
    columns, rows = weights["comb"].sum(-2), weights["comb"].sum(-1)
    post, pre = ([round(v, 2) for v in weights[key][0, 0].tolist()] for key in ("post", "pre"))
    print(f"comb columns sum to 1 within {(columns - 1).abs().max():.1e}, rows within {(rows - 1).abs().max():.1e} "
          f"(Sinkhorn-Knopp, {mhc.config.hc_sinkhorn_iters} iterations); layer 1's attention: post {post}, pre {pre}")

    # 3. the figure of every sub-layer's weights
    figure = plot_mhc_analysis(mhc, Path(args.output_dir), sample, f"{name}, {args.steps} steps")
    print(f"hyper-connection weights drawn to {figure}")

    # 4. upcycling: the converted Llama starts with the Llama's logits
    upcycled = llama_to_mhc(llama, hc_mult=args.hc_mult).eval()
    with torch.no_grad():
        diff = (upcycled(val_blocks).logits - llama(val_blocks).logits).abs().max().item()
    print(f"Llama -> mhc n{args.hc_mult}  max |Δlogits| {diff:.2e} (its hyper-connections start as a plain residual)")

    # 5. generation and export
    prompt = torch.tensor([tokenizer("And God said").input_ids])
    cached = mhc.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    uncached = mhc.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False,
                            pad_token_id=tokenizer.pad_token_id)
    same = "same" if torch.equal(cached, uncached) else "DIFFERENT"
    print(f"greedy ({same} with and without the cache): {tokenizer.decode(cached[0], skip_special_tokens=True)!r}")
    with tempfile.TemporaryDirectory() as folder:
        save_remote_code_folder(mhc, Path(folder) / "export", tokenizer)
        loaded = AutoModelForCausalLM.from_pretrained(Path(folder) / "export", trust_remote_code=True).eval()
        with torch.no_grad():
            diff = (loaded(val_blocks).logits - mhc(val_blocks).logits).abs().max().item()
        files = sorted(p.name for p in (Path(folder) / "export").glob("*.py"))
        print(f"remote code {files} -> {type(loaded).__name__}: max |Δlogits| {diff:.1e}")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
