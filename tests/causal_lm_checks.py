"""Generation checks shared by the causal-LM families (DenseFormer, MoDA): cached == uncached.

Each test module passes its own tiny model; vocabulary ids 0-2 are pad/bos/eos in the tiny configs.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, GenerationConfig

from depthfusion_hf.models.transformers_compat import output_cache

# The shared tiny decoder shape (GQA 4 query / 2 KV heads); ids 0-2 are pad/bos/eos, the checks draw from 3-96.
TINY_DECODER = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

GENERATION_MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=20),
    "beam": dict(num_beams=3, do_sample=False),
}


def assert_incremental_logits_equal_full_forward(model, vocab_size: int = 97) -> None:
    """Prefill 7 tokens, one 2-token step (S > T > 1), then 1-token steps: the logits equal one full forward."""
    ids = torch.randint(3, vocab_size, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :7], cache=cache, use_cache=True).logits]
        steps.append(model(ids[:, 7:9], cache=cache, use_cache=True).logits)
        for t in range(9, 12):
            steps.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert cache.get_seq_length() == 12
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def assert_past_key_values_alias_uses_the_cache(model, vocab_size: int = 97) -> None:
    """The deprecated ``past_key_values`` keyword still feeds the cache to the forward."""
    ids = torch.randint(3, vocab_size, (1, 6))
    with torch.no_grad():
        cache = output_cache(model(ids[:, :5], use_cache=True))
        assert cache.get_seq_length() == 5
        step = model(ids[:, 5:], past_key_values=cache).logits
        torch.testing.assert_close(step[:, -1], model(ids).logits[:, -1], rtol=1e-5, atol=1e-5)


def generate(model, ids: torch.Tensor, mask: torch.Tensor | None = None, use_cache: bool = True, **kwargs):
    """``model.generate`` for 6 new tokens with scores; ``ids`` [B, T], ``mask`` [B, T] (1 = token)."""
    config = GenerationConfig(max_new_tokens=6, pad_token_id=0, eos_token_id=None, use_cache=use_cache, **kwargs)
    return model.generate(ids, attention_mask=mask, generation_config=config, output_scores=True,
                          return_dict_in_generate=True)


def assert_cached_generation_equals_uncached(model, mode: str, vocab_size: int = 97) -> None:
    """Same sequences and (finite) scores with and without the KV cache, for a generation ``mode``."""
    ids = torch.randint(3, vocab_size, (2, 5))
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        outs.append(generate(model, ids, use_cache=use_cache, **GENERATION_MODES[mode]))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].scores, outs[1].scores):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        torch.testing.assert_close(a[finite], b[finite], rtol=1e-4, atol=1e-4)


def assert_left_padding_matches_single_sequences(model, vocab_size: int = 97) -> None:
    """A left-padded batch generates what each sequence generates alone, cached and uncached."""
    short = torch.randint(3, vocab_size, (1, 4))
    long = torch.randint(3, vocab_size, (1, 7))
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    batched = generate(model, batch, mask, do_sample=False)
    alone_short = generate(model, short, do_sample=False)
    alone_long = generate(model, long, do_sample=False)
    assert torch.equal(batched.sequences[0, 3:], alone_short.sequences[0])
    assert torch.equal(batched.sequences[1], alone_long.sequences[0])
    for step, (a, b) in enumerate(zip(batched.scores, alone_short.scores)):
        torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-4, msg=f"step {step}")
    uncached = generate(model, batch, mask, use_cache=False, do_sample=False)
    assert torch.equal(batched.sequences, uncached.sequences)


def assert_a_few_adamw_steps_lower_the_loss(model, steps: int = 5, vocab_size: int = 97) -> None:
    """Train ``model`` on one batch for ``steps`` AdamW steps (lr 1e-2): its loss must fall."""
    ids = torch.randint(3, vocab_size, (4, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < first
