"""Compiled static-cache decoding of DenseFormer equals eager decoding, in one graph compiled once (issue 21;
the check: ``tests/compiled_decoding.py``; Llama, the control: ``tests/test_compiled_decoding.py``)."""

import pytest
import torch

from depthfusion_hf import DenseFormerForCausalLM
from tests.compiled_decoding import assert_compiled_decoding_matches_eager

from .helpers import randomise_dwa, tiny_config


# 1x1: a DWA step after every block over all earlier outputs; 2x2: every second block, every second output.
@pytest.mark.parametrize(("dilation", "period"), [(1, 1), (2, 2)], ids=["1x1", "2x2"])
def test_compiled_static_cache_decoding_matches_eager(dilation, period):
    torch.manual_seed(0)
    model = DenseFormerForCausalLM(tiny_config(num_hidden_layers=4, dwa_dilation=dilation, dwa_period=period))
    randomise_dwa(model, seed=1)
    assert_compiled_decoding_matches_eager(model)
