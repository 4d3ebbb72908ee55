"""Cached generation equals uncached computation (greedy, sampling, beam search, left padding)."""

import pytest
import torch
from transformers import DynamicCache

from depthfusion_hf import DenseFormerForCausalLM
from tests.causal_lm_checks import (
    GENERATION_MODES,
    assert_cached_generation_equals_uncached,
    assert_left_padding_matches_single_sequences,
)

from .helpers import randomise_dwa, tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = DenseFormerForCausalLM(tiny_config(dwa_dilation=2, dwa_period=1)).eval()
    randomise_dwa(m, seed=1)
    return m


def test_incremental_logits_equal_full_forward(model):
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        prefill = model(ids[:, :8], cache=cache, use_cache=True)
        steps = [prefill.logits]
        for t in range(8, 12):
            steps.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_past_key_values_alias_uses_the_cache(model):
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        cache = model(ids[:, :5], use_cache=True).cache
        assert cache.get_seq_length() == 5
        step = model(ids[:, 5:], past_key_values=cache).logits
        torch.testing.assert_close(step[:, -1], model(ids).logits[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", sorted(GENERATION_MODES))
def test_generate_cached_equals_uncached(model, mode):
    assert_cached_generation_equals_uncached(model, mode)


def test_left_padded_batch_matches_single_sequences(model):
    assert_left_padding_matches_single_sequences(model)
