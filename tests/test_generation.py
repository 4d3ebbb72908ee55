"""Cached generation equals uncached computation, for every causal family and the variants of its entry in
``tests/family_cases.py``: incremental prefill and decoding steps, the ``past_key_values`` alias, ``generate``
greedy / sampling with a seed / beam search, and a left-padded batch. Vocabulary ids 0-2 are pad/bos/eos."""

import pytest
import torch
from transformers import DynamicCache

from depthfusion_hf.models.transformers_compat import output_cache
from tests.causal_lm_checks import generate
from tests.family_cases import params, tiny_model

VOCAB = 97
GENERATION_MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=20),
    "beam": dict(num_beams=3, do_sample=False),
}


@pytest.fixture(scope="module", params=[pytest.param(p.values, id=p.id) for p in params("generation")])
def model(request):
    family, overrides = request.param
    return tiny_model(family, **overrides)


def test_incremental_logits_equal_full_forward(model):
    """Prefill 7 tokens, one 2-token step (S > T > 1), then 1-token steps: the logits equal one full forward."""
    ids = torch.randint(3, VOCAB, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :7], cache=cache, use_cache=True).logits]
        steps.append(model(ids[:, 7:9], cache=cache, use_cache=True).logits)
        for t in range(9, 12):
            steps.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert cache.get_seq_length() == 12
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_past_key_values_alias_uses_the_cache(model):
    """The deprecated ``past_key_values`` keyword still feeds the cache to the forward."""
    ids = torch.randint(3, VOCAB, (1, 6))
    with torch.no_grad():
        cache = output_cache(model(ids[:, :5], use_cache=True))
        assert cache.get_seq_length() == 5
        step = model(ids[:, 5:], past_key_values=cache).logits
        torch.testing.assert_close(step[:, -1], model(ids).logits[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", sorted(GENERATION_MODES))
def test_generate_cached_equals_uncached(model, mode):
    """Same sequences and (finite) scores with and without the KV cache."""
    ids = torch.randint(3, VOCAB, (2, 5))
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        outs.append(generate(model, ids, use_cache=use_cache, **GENERATION_MODES[mode]))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].scores, outs[1].scores):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        torch.testing.assert_close(a[finite], b[finite], rtol=1e-4, atol=1e-4)


def test_left_padded_batch_matches_single_sequences(model):
    """A left-padded batch generates what each sequence generates alone, cached and uncached."""
    short = torch.randint(3, VOCAB, (1, 4))
    long = torch.randint(3, VOCAB, (1, 7))
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    batched = generate(model, batch, mask, do_sample=False)
    alone_short = generate(model, short, do_sample=False)
    alone_long = generate(model, long, do_sample=False)
    # A sequence that ends (eos) before the longest one is padded after its end in the batch.
    ended = alone_short.sequences.shape[1]
    assert torch.equal(batched.sequences[0, 3:3 + ended], alone_short.sequences[0])
    assert (batched.sequences[0, 3 + ended:] == model.generation_config.pad_token_id).all()
    assert torch.equal(batched.sequences[1, :alone_long.sequences.shape[1]], alone_long.sequences[0])
    for step, (a, b) in enumerate(zip(batched.scores, alone_short.scores)):
        torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-4, msg=f"step {step}")
    uncached = generate(model, batch, mask, use_cache=False, do_sample=False)
    assert torch.equal(batched.sequences, uncached.sequences)
