"""Compiled static-cache decoding of AttnRes (full and block) equals eager decoding, in one graph compiled once
(issue 21; the check: ``tests/compiled_decoding.py``; Llama, the control: ``tests/test_compiled_decoding.py``)."""

import pytest
import torch

from depthfusion_hf.models.modeling_attnres import AttnResForCausalLM
from tests.compiled_decoding import assert_compiled_decoding_matches_eager

from .helpers import randomise_attnres, tiny_config


# full: every call over all earlier sub-layer outputs; block 3: blocks end mid-layer (attention and MLP alternate).
@pytest.mark.parametrize("block_size", [None, 3], ids=["full", "block3"])
def test_compiled_static_cache_decoding_matches_eager(block_size):
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(num_hidden_layers=2, attnres_block_size=block_size))
    randomise_attnres(model, seed=1)
    assert_compiled_decoding_matches_eager(model)
