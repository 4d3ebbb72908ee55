"""Conversion exactness on real pretrained weights (issue 28): the first two layers, final norm and 1,080 embedding
rows of SmolLM2-135M-Instruct (``tests/data/smollm2_135m_2_layers.safetensors``, 4.9 MiB, written by
``scripts/extract_real_layers.py``, every value bit for bit the float model's) built into a 2-layer Llama, and two
held-out King James Bible passages [2, 96] in its ids.

Per family, at conversion: the logits within the converter's stated bound of the source's (DenseFormer: equal;
mHC and the gated MoDA: float32 rounding; AttnRes: the Llama with each norm's eps replaced by N^2 eps, its documented
effect, to float32 rounding), perplexity within 0.5 % of the source's, and the greedy continuation equal to the
source's (AttnRes: not asked; it holds here). Real weights make hidden states and logits of a real model's scale
(max |logit| 73 here), which random tiny Llamas do not.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from depthfusion_hf import MoDAConfig, upcycle

from .test_compare_families import load_script

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "smollm2_135m_2_layers.safetensors"
PPL_TOLERANCE = 0.005
ROUNDING = 2e-6  # of max |logit|: float32 rounding through two real layers (measured: mHC 4.7e-7, AttnRes <= 4.2e-7)
PROMPT, NEW_TOKENS = 32, 16
MODA_GATED = "moda_depth_gate" in MoDAConfig().to_dict()


@pytest.fixture(scope="module")
def source():
    llama, ids = load_script("extract_real_layers").load_real_layers(DATA)
    ids = ids.long()
    with torch.no_grad():
        logits = llama(ids).logits  # [2, 96, V]
        loss = llama(ids, labels=ids).loss.item()
        greedy = llama.generate(ids[:, :PROMPT], attention_mask=torch.ones_like(ids[:, :PROMPT]),
                                max_new_tokens=NEW_TOKENS, do_sample=False)
    return llama, ids, logits, loss, greedy


def test_the_real_layers_are_a_real_models(source):
    llama, ids, logits, _, _ = source
    config = llama.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 1080)
    assert ids.shape == (2, 96) and 0 <= ids.min() and ids.max() < config.vocab_size
    # trained weights: a Q4_1 layer's matrices, not an init (std 0.02), and logits of a trained model's scale
    assert llama.model.layers[0].mlp.down_proj.weight.std() > 0.03 and logits.abs().max() > 50


def eps_replaced_llama(llama, sources_read: list[int], sources_final: int):
    """The Llama whose sub-layer s norm has eps ``sources_read[s]**2 * eps`` and final norm ``sources_final**2 * eps``:
    what upcycled AttnRes computes (``convert.llama_to_attnres``: uniform averages read through RMSNorms)."""
    reference = copy.deepcopy(llama)
    eps = llama.config.rms_norm_eps
    for i, layer in enumerate(reference.model.layers):
        layer.input_layernorm.variance_epsilon = sources_read[2 * i] ** 2 * eps
        layer.post_attention_layernorm.variance_epsilon = sources_read[2 * i + 1] ** 2 * eps
    reference.model.norm.variance_epsilon = sources_final**2 * eps
    return reference


CASES = {
    "denseformer": ({}, None),
    "mhc n4": ({"hc_mult": 4}, None),
    # sources an AttnRes call averages before sub-layer s (0..3) and before the final norm: the embedding, then full:
    # every sub-layer output; blocks of 2: the completed blocks' sums and the running one; one block of 4: its sum
    "attnres full": ({"attnres_block_size": None}, ([1, 2, 3, 4], 5)),
    "attnres block 2": ({"attnres_block_size": 2}, ([1, 2, 2, 3], 3)),
    "attnres block 4": ({"attnres_block_size": 4}, ([1, 2, 2, 2], 2)),
    "moda": ({}, None),
}


@pytest.mark.parametrize(
    "case",
    [pytest.param(name, marks=pytest.mark.xfail(
        name == "moda" and not MODA_GATED, strict=True,
        reason="MoDA's conversion keeps the Llama only with the closed depth gate (issue 28 item 1); without it the "
               "logits move by 18 (ungated depth entries share the softmax)")) for name in CASES])
def test_upcycled_real_layers_keep_the_source(case, source):
    llama, ids, logits, loss, greedy = source
    options, attnres_sources = CASES[case]
    family = case.split()[0]
    model = upcycle(llama, family, **options).eval()
    scale = logits.abs().max().item()
    with torch.no_grad():
        out = model(ids).logits
        converted_loss = model(ids, labels=ids).loss.item()
        converted_greedy = model.generate(ids[:, :PROMPT], attention_mask=torch.ones_like(ids[:, :PROMPT]),
                                          max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = logits if attnres_sources is None else eps_replaced_llama(llama, *attnres_sources)(ids).logits
    difference = (out - expected).abs().max().item()
    if family == "denseformer":
        assert difference == 0  # identity DWA: the Llama's own computation
    else:
        assert difference <= ROUNDING * scale, (difference, scale)
    if attnres_sources is not None:  # the eps effect itself is real and small: it moves the logits ~1e-3 relative
        assert 1e-4 * scale < (out - logits).abs().max().item() < 3e-3 * scale
    assert abs(math.exp(converted_loss - loss) - 1) <= PPL_TOLERANCE
    assert torch.equal(converted_greedy, greedy)
