"""The compiled static-cache decoding check (``tests/compiled_decoding.py``) on transformers' Llama, the control,
and on Llamas broken on purpose: a graph break, a recompile per step, other numbers when compiled, and a model
that does not claim ``_can_compile_fullgraph``: each must fail the check, naming what is wrong."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .causal_lm_checks import TINY_DECODER
from .compiled_decoding import assert_compiled_decoding_matches_eager, left_padded_batch

TINY = dict(TINY_DECODER, num_hidden_layers=2)


def tiny_llama(model_class: type = LlamaForCausalLM) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return model_class(LlamaConfig(**TINY))


class GraphBreakLlama(LlamaForCausalLM):
    """Breaks the graph in every forward."""

    def forward(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return super().forward(*args, **kwargs)


class RecompilingLlama(LlamaForCausalLM):
    """Reads a Python counter it changes every step: dynamo guards on its value and recompiles each step."""

    steps = 0

    def forward(self, *args, **kwargs):
        self.steps += 1
        out = super().forward(*args, **kwargs)
        out.logits = out.logits + 0.0 * self.steps
        return out


class CompiledDiffersLlama(LlamaForCausalLM):
    """Reverses the vocabulary of its logits when traced: other tokens than eager."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if torch.compiler.is_compiling():
            out.logits = out.logits.flip(-1)
        return out


class NoClaimLlama(LlamaForCausalLM):
    _can_compile_fullgraph = False


def test_left_padded_batch_pads_the_shorter_prompt_on_the_left():
    ids, mask = left_padded_batch(97, 0, (7, 4))
    assert ids.shape == mask.shape == (2, 7)
    assert mask[0].tolist() == [1] * 7 and mask[1].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert ids[1, :3].tolist() == [0, 0, 0] and bool((ids[mask.bool()] >= 3).all())


def test_llama_compiled_static_decoding_matches_eager():
    result = assert_compiled_decoding_matches_eager(tiny_llama())
    assert result.graphs == 1 and result.sequences.shape == (2, 7 + 5)


def test_graph_break_fails():
    with pytest.raises(torch._dynamo.exc.Unsupported, match="graph_break"):
        assert_compiled_decoding_matches_eager(tiny_llama(GraphBreakLlama))


def test_recompile_per_step_fails():
    with pytest.raises(AssertionError, match=r"recompiled after 1 graph\(s\)(?s:.*)self\.steps == "):
        assert_compiled_decoding_matches_eager(tiny_llama(RecompilingLlama))


def test_other_tokens_when_compiled_fail():
    with pytest.raises(AssertionError, match="other tokens than eager"):
        assert_compiled_decoding_matches_eager(tiny_llama(CompiledDiffersLlama))


def test_model_without_the_claim_fails():
    with pytest.raises(AssertionError, match="_can_compile_fullgraph is False"):
        assert_compiled_decoding_matches_eager(tiny_llama(NoClaimLlama))
