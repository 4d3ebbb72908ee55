"""Cached generation equals uncached (greedy, sampling, beam search, left padding): the streams are per token, the
ordinary KV cache suffices."""

import pytest
import torch

from depthfusion_hf.models.modeling_mhc import MHCForCausalLM
from tests.causal_lm_checks import (
    GENERATION_MODES,
    assert_cached_generation_equals_uncached,
    assert_incremental_logits_equal_full_forward,
    assert_left_padding_matches_single_sequences,
    assert_past_key_values_alias_uses_the_cache,
)

from .helpers import randomise_mhc, tiny_config


@pytest.fixture(scope="module", params=[1, 4], ids=["n1", "n4"])
def model(request):
    torch.manual_seed(0)
    return randomise_mhc(MHCForCausalLM(tiny_config(hc_mult=request.param))).eval()


def test_incremental_logits_equal_full_forward(model):
    assert_incremental_logits_equal_full_forward(model)


def test_past_key_values_alias_uses_the_cache(model):
    assert_past_key_values_alias_uses_the_cache(model)


@pytest.mark.parametrize("mode", sorted(GENERATION_MODES))
def test_cached_generation_equals_uncached(model, mode):
    assert_cached_generation_equals_uncached(model, mode)


def test_left_padding_matches_single_sequences(model):
    assert_left_padding_matches_single_sequences(model)
