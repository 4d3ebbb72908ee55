"""Cached generation equals uncached computation (greedy, sampling, beam search, left padding)."""

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from .helpers import tiny_model


@pytest.fixture(scope="module", params=["pre", "post"])
def model(request):
    return tiny_model(seed=1, norm_position=request.param)


def test_incremental_logits_equal_full_forward(model):
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :7], cache=cache, use_cache=True).logits]
        steps.append(model(ids[:, 7:9], cache=cache, use_cache=True).logits)  # a multi-token step (S > T > 1)
        for t in range(9, 12):
            steps.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert cache.get_seq_length() == 12
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_past_key_values_alias_uses_the_cache(model):
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        cache = model(ids[:, :5], use_cache=True).cache
        assert cache.get_seq_length() == 5
        step = model(ids[:, 5:], past_key_values=cache).logits
        torch.testing.assert_close(step[:, -1], model(ids).logits[:, -1], rtol=1e-5, atol=1e-5)


def _generate(model, ids, mask=None, use_cache=True, **kwargs):
    config = GenerationConfig(max_new_tokens=6, pad_token_id=0, eos_token_id=None, use_cache=use_cache, **kwargs)
    return model.generate(ids, attention_mask=mask, generation_config=config, output_scores=True,
                          return_dict_in_generate=True)


@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
def test_generate_cached_equals_uncached(model, mode):
    ids = torch.randint(3, 97, (2, 5))
    kwargs = {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, top_k=20),
              "beam": dict(num_beams=3, do_sample=False)}[mode]
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        outs.append(_generate(model, ids, use_cache=use_cache, **kwargs))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].scores, outs[1].scores):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        torch.testing.assert_close(a[finite], b[finite], rtol=1e-4, atol=1e-4)


def test_left_padded_batch_matches_single_sequences(model):
    short = torch.randint(3, 97, (1, 4))
    long = torch.randint(3, 97, (1, 7))
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    batched = _generate(model, batch, mask, do_sample=False)
    alone_short = _generate(model, short, do_sample=False)
    alone_long = _generate(model, long, do_sample=False)
    assert torch.equal(batched.sequences[0, 3:], alone_short.sequences[0])
    assert torch.equal(batched.sequences[1], alone_long.sequences[0])
    for step, (a, b) in enumerate(zip(batched.scores, alone_short.scores)):
        torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-4, msg=f"step {step}")
    uncached = _generate(model, batch, mask, use_cache=False, do_sample=False)
    assert torch.equal(batched.sequences, uncached.sequences)
