#!/usr/bin/env python
"""Text generation with DenseFormer and MoDA: greedy, sampling, beam search, and the pipeline.

    python examples/generation.py          # under a minute on CPU

Both models are tiny and trained here for a few seconds on the King James Bible (the package's built-in
corpus), so they produce Bible-flavoured word salad; the point is the API. Each model also shows that
decoding with the KV cache gives the same greedy continuation as recomputing the whole prefix each step.
"""

from __future__ import annotations

import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, pipeline
from transformers.utils import logging

import depthfusion_hf  # noqa: F401  (registers the model types with the Auto classes)
from depthfusion_hf.data.corpus import load_kjv_chapters, pack_into_blocks, train_bpe_tokenizer

PROMPT = "And God said"
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def train_briefly(model, blocks: torch.Tensor, steps: int = 60, batch_size: int = 8) -> float:
    """A few AdamW steps on random batches of ``blocks`` [N, T]; returns the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        batch = blocks[torch.randint(0, len(blocks), (batch_size,), generator=generator)]  # [B, T]
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return loss.item()


def show(name: str, model, tokenizer) -> None:
    """Greedy, sampling and beam-search continuations of ``PROMPT``."""
    inputs = tokenizer(PROMPT, return_tensors="pt")  # input_ids [1, T]
    common = dict(max_new_tokens=24, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        greedy = model.generate(**inputs, do_sample=False, **common)
        uncached = model.generate(**inputs, do_sample=False, use_cache=False, **common)
        torch.manual_seed(1)
        sampled = model.generate(**inputs, do_sample=True, temperature=0.8, top_k=40, top_p=0.95, **common)
        beams = model.generate(**inputs, num_beams=4, num_return_sequences=2, early_stopping=True, **common)
    assert torch.equal(greedy, uncached), "cached and uncached greedy decoding disagree"
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True).replace("\n", " ")  # noqa: E731
    print(f"\n[{name}]")
    print(f"  greedy (same with and without the cache): {decode(greedy[0])!r}")
    print(f"  sampling (T=0.8, top-k 40, top-p 0.95):   {decode(sampled[0])!r}")
    for i, beam in enumerate(beams):
        print(f"  {f'beam search, 4 beams, #{i + 1}:':<42}{decode(beam)!r}")


def main() -> None:
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast and shares a busy CPU better
    torch.manual_seed(0)
    start = time.perf_counter()
    chapters = load_kjv_chapters()[:80]
    tokenizer = train_bpe_tokenizer(chapters, vocab_size=512)
    blocks = torch.tensor(pack_into_blocks(tokenizer, chapters, block_size=48, max_blocks=400)["input_ids"])
    special = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    configs = {
        "DenseFormer 2x2": AutoConfig.for_model("denseformer", **SHAPE, **special, dwa_dilation=2, dwa_period=2),
        "MoDA (FFN-side depth KV)": AutoConfig.for_model("moda", **SHAPE, **special, moda_ffn_kv=True),
    }
    for name, config in configs.items():
        model = AutoModelForCausalLM.from_config(config)
        loss = train_briefly(model, blocks)
        print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters, loss after 60 steps {loss:.2f}")
        show(name, model, tokenizer)
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        text = generator(PROMPT, max_new_tokens=16, do_sample=False)[0]["generated_text"]
        print(f"  {'pipeline(text-generation):':<42}{text!r}")
    print(f"\ndone in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
