"""Compiled static-cache decoding equals eager decoding, in one graph compiled once (issue 21).

transformers compiles the one-token decoding step itself when the cache is static
(``generate(..., cache_implementation="static")``) and either the device is CUDA or the generation's
``compile_config`` has ``_compile_all_devices`` set (its own tests set it on CPU): the step runs through
``torch.compile(model.__call__, **compile_config.to_dict())``; the prefill stays eager. In transformers 5.24
``_can_compile_fullgraph`` is only the model's claim that this works (``generate`` does not read it);
:func:`assert_compiled_decoding_matches_eager` is the test of the claim:

1. greedy ``generate`` of ``new_tokens`` tokens with the dynamic cache, eager: the reference;
2. the same with ``cache_implementation="static"`` and ``CompileConfig(fullgraph=True, dynamic=False)``: a graph
   break fails the capture (fullgraph: dynamo's ``Unsupported`` with its reason), and a recompile fails with the
   guard that failed (dynamo's ``error_on_recompile``): one graph serves all ``new_tokens - 1`` decoding steps;
3. once more: a new ``generate`` (a reset static cache) reuses that graph; the backend counts the graphs it is
   given (exactly one in all);

and both compiled runs give the reference's tokens exactly and its logits to float32 rounding. The batch is two
prompts of different lengths, the shorter left-padded, with its attention mask. The backend is ``aot_eager``
(dynamo capture and AOT autograd's functional graph, which is where an in-place cache update or a Python-side
effect would fail; inductor's code generation only changes how the graph runs and costs a C++ build per model on
a CPU); pass ``backend="inductor"`` to include it. Cost on the 2-core machine: about 2.5 s of CPU per 2-layer model
with ``aot_eager``.

Run on every causal family's variants of ``tests/family_cases.py`` (``compiled_decoding``), and on transformers'
Llama, the control, and on Llamas broken on purpose: a graph break, a recompile per step, other numbers when
compiled, and a model that does not claim ``_can_compile_fullgraph``: each must fail the check, naming what is wrong.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

from tests.causal_lm_checks import TINY_DECODER
from tests.family_cases import params, tiny_model

# float32 logits of the compiled static-cache step against the eager dynamic-cache one: the static cache's masked
# slots and the graph's operator order change sums by a few float32 roundings of logits of order 1.
LOGIT_RTOL = 1e-5
LOGIT_ATOL = 1e-5


@dataclass
class CompiledDecoding:
    """What :func:`assert_compiled_decoding_matches_eager` measured.

    Attributes:
        sequences: [2, P + new_tokens] the generated ids (prompt included), equal for eager and compiled.
        graphs: graphs the backend compiled over both compiled ``generate`` calls (1 when it passes).
        first_call_s: process CPU seconds of the first compiled ``generate`` (mostly the compilation).
    """

    sequences: torch.Tensor
    graphs: int
    first_call_s: float


def left_padded_batch(vocab_size: int, pad_token_id: int, prompt_lengths: tuple[int, int],
                      seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of the given lengths, the shorter left-padded with ``pad_token_id``.

    Returns:
        (input_ids [2, max(prompt_lengths)], attention_mask [2, max(prompt_lengths)], 1 = token, 0 = padding).
        Ids are drawn from ``[3, vocab_size)`` (0-2 are pad/bos/eos in the tiny configs).
    """
    width = max(prompt_lengths)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (len(prompt_lengths), width), generator=gen)
    mask = torch.ones_like(ids)
    for row, length in enumerate(prompt_lengths):
        ids[row, : width - length] = pad_token_id
        mask[row, : width - length] = 0
    return ids, mask


def assert_compiled_decoding_matches_eager(model: torch.nn.Module, new_tokens: int = 5,
                                           prompt_lengths: tuple[int, int] = (7, 4), backend: str = "aot_eager",
                                           seed: int = 0) -> CompiledDecoding:
    """Compiled static-cache greedy decoding equals eager dynamic-cache greedy decoding, in one graph (see the
    module docstring).

    Args:
        model: a tiny causal LM (its parameters are cast to float32 and it is put in eval mode).
        new_tokens: tokens to generate (``new_tokens - 1`` compiled steps; at least 3, so that a recompile from
            one step to the next is seen).
        prompt_lengths: the two prompt lengths; they must differ (the shorter is left-padded).
        backend: the ``torch.compile`` backend the graph count wraps (``aot_eager``, ``inductor``, ``eager``).
        seed: seed of the prompts.
    Raises:
        torch._dynamo.exc.Unsupported: a graph break (dynamo's reason and the line that breaks).
        AssertionError: naming what differs: the flag, a recompile (with the guard that failed), the graph
            count, tokens or logits.
    """
    assert new_tokens >= 3, "new_tokens must be >= 3: two compiled steps at least, so a recompile is seen"
    assert prompt_lengths[0] != prompt_lengths[1], "prompt_lengths must differ (left padding is part of the test)"
    assert type(model)._can_compile_fullgraph is True, (
        f"{type(model).__name__}._can_compile_fullgraph is {type(model)._can_compile_fullgraph}: this checks the "
        "claim that the decoding step compiles whole; set it to True with the test")
    model = model.float().eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids, mask = left_padded_batch(model.config.vocab_size, pad, prompt_lengths, seed)
    settings = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                    pad_token_id=pad, return_dict_in_generate=True, output_logits=True)

    graphs: list[torch.fx.GraphModule] = []
    inner = torch._dynamo.lookup_backend(backend)

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return inner(graph, example_inputs)

    config = CompileConfig(fullgraph=True, dynamic=False, backend=counting_backend, mode="default")
    config._compile_all_devices = True  # transformers compiles on CPU only when asked (as its own tests do)

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = model.generate(ids, disable_compile=True, **settings)
            start = time.process_time()
            try:
                with torch._dynamo.config.patch(error_on_recompile=True):
                    first = model.generate(ids, cache_implementation="static", compile_config=config, **settings)
                    first_call_s = time.process_time() - start
                    second = model.generate(ids, cache_implementation="static", compile_config=config, **settings)
            except torch._dynamo.exc.RecompileError as error:
                raise AssertionError(
                    f"{type(model).__name__}: the decoding step was recompiled after {len(graphs)} graph(s) "
                    f"(a guard failed from one step or generate call to the next):\n{error}") from error
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, f"{type(model).__name__}: {len(graphs)} graphs compiled (expected 1)"
    for name, got in (("first", first), ("second", second)):
        assert torch.equal(got.sequences, want.sequences), (
            f"{type(model).__name__}: {name} compiled static-cache generate gave other tokens than eager:\n"
            f"{got.sequences.tolist()}\nvs eager\n{want.sequences.tolist()}")
        for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
            torch.testing.assert_close(a, b, rtol=LOGIT_RTOL, atol=LOGIT_ATOL,
                                       msg=lambda m, s=step, n=name: f"{n} compiled run, step {s} logits: {m}")
    return CompiledDecoding(sequences=want.sequences, graphs=len(graphs), first_call_s=first_call_s)


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


@pytest.mark.parametrize(("family", "overrides"), params("compiled_decoding"))
def test_compiled_static_cache_decoding_matches_eager(family, overrides):
    result = assert_compiled_decoding_matches_eager(tiny_model(family, **overrides))
    assert result.graphs == 1


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
