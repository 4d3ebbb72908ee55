"""Cached generation equals uncached computation (greedy, sampling, beam search, left padding), full and block."""

import pytest
import torch

from depthfusion_hf.models.modeling_attnres import AttnResForCausalLM
from tests.causal_lm_checks import (
    GENERATION_MODES,
    assert_cached_generation_equals_uncached,
    assert_incremental_logits_equal_full_forward,
    assert_left_padding_matches_single_sequences,
    assert_past_key_values_alias_uses_the_cache,
)

from .helpers import randomise_attnres, tiny_config


@pytest.fixture(scope="module", params=[None, 3], ids=["full", "block3"])
def model(request):
    torch.manual_seed(0)
    m = AttnResForCausalLM(tiny_config(attnres_block_size=request.param)).eval()
    randomise_attnres(m, seed=1)
    return m


def test_incremental_logits_equal_full_forward(model):
    assert_incremental_logits_equal_full_forward(model)


def test_past_key_values_alias_uses_the_cache(model):
    assert_past_key_values_alias_uses_the_cache(model)


@pytest.mark.parametrize("mode", sorted(GENERATION_MODES))
def test_generate_cached_equals_uncached(model, mode):
    assert_cached_generation_equals_uncached(model, mode)


def test_left_padded_batch_matches_single_sequences(model):
    assert_left_padding_matches_single_sequences(model)
