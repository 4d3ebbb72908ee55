"""The tiny decoder shape and small checks shared by the causal-LM families' tests (the behaviour tests over every
family: ``tests/family_cases.py``). Vocabulary ids 0-2 are pad/bos/eos in the tiny configs."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

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


def generate(model, ids: torch.Tensor, mask: torch.Tensor | None = None, use_cache: bool = True, **kwargs):
    """``model.generate`` for 6 new tokens with scores; ``ids`` [B, T], ``mask`` [B, T] (1 = token)."""
    config = GenerationConfig(max_new_tokens=6, pad_token_id=0, eos_token_id=None, use_cache=use_cache, **kwargs)
    return model.generate(ids, attention_mask=mask, generation_config=config, output_scores=True,
                          return_dict_in_generate=True)


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
