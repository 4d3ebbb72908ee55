"""Compiled static-cache decoding of mHC equals eager decoding, in one graph compiled once (issue 21; the check:
``tests/compiled_decoding.py``; Llama, the control: ``tests/test_compiled_decoding.py``)."""

import torch

from depthfusion_hf.models.modeling_mhc import MHCForCausalLM
from tests.compiled_decoding import assert_compiled_decoding_matches_eager

from .helpers import randomise_mhc, tiny_config


def test_compiled_static_cache_decoding_matches_eager():
    torch.manual_seed(0)
    model = randomise_mhc(MHCForCausalLM(tiny_config(num_hidden_layers=2)), seed=1)  # n = 4, 20 Sinkhorn iterations
    result = assert_compiled_decoding_matches_eager(model)
    assert result.graphs == 1
