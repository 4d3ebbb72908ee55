"""``torch.compile`` of every family gives the eager model's numbers: training (loss and every gradient,
over two optimiser steps, so the compiled graphs are reused after the parameters changed), a forward without
gradients, and ``generate`` (prefill and one-token steps on the cache) with a compiled forward.

Every family runs one code path, eager or compiled (no state kept on Python objects). The backend is ``aot_eager``:
dynamo's tracing and AOT autograd (where our Python meets the compiler) without inductor's C++ code generation
(seconds, not minutes, on a CPU); inductor changes only how the traced graph is executed.

float64 models: AOT autograd's decompositions may reorder sums, so values are compared to ``64 eps64`` times their
scale.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from depthfusion_hf.families import causal_lm_families

from .family_cases import CASES, tiny_model

EPS64 = torch.finfo(torch.float64).eps
# "family-variant" -> (family, config fields): the torch_compile variants of every causal family's entry
VARIANTS = {f"{family}-{variant}": (family, overrides) for family in causal_lm_families()
            for variant, overrides in CASES[family].torch_compile.items()}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (no graphs cached from another model)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def float64_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The variant in float64 with every parameter moved off its initial value (zero pseudo-queries, unit norms
    and identity DWA weights would hide a wrong path)."""
    family, overrides = VARIANTS[name]
    model = tiny_model(family, seed, num_hidden_layers=4, **overrides).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max().clamp_min(1.0)
    err = (got - want).abs().max()
    assert err <= 64 * EPS64 * scale, f"{what}: max |diff| {err.item():.3g} over scale {scale.item():.3g}"


# Every variant on the default path and on each other path of its family's entry (AttnRes's list path: the tiny
# shapes then take the training path of real sizes).
TRAIN_CASES = [pytest.param(name, setter, id=f"{name}-{path}") for name, (family, _) in VARIANTS.items()
               for path, setter in {"default": None, **CASES[family].paths}.items()]


@pytest.mark.parametrize(("name", "path"), TRAIN_CASES)
def test_compiled_training_matches_eager(name, path, monkeypatch):
    """Two SGD steps on a left-padded batch: the compiled model (``fullgraph``: the forward with the mask, RoPE, the
    op's dispatch and custom Function, and its backward, in one graph) gives the eager model's loss and every
    gradient at each step."""
    if path is not None:
        path(monkeypatch)
    eager = float64_model(name).train()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, compiled_model)]
    gen = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    for step in range(2):
        ids = torch.randint(3, 97, (2, 10), generator=gen)
        want = eager(input_ids=ids, attention_mask=mask, labels=ids).loss
        want.backward()
        got = compiled(input_ids=ids, attention_mask=mask, labels=ids).loss
        got.backward()
        assert_close(got.detach(), want.detach(), f"loss at step {step}")
        for (n, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            assert q.grad is not None, f"{n}: no gradient through the compiled model"
            assert_close(q.grad, p.grad, f"gradient of {n} at step {step}")
        for opt in optimisers:
            opt.step()
            opt.zero_grad()


# Decoding on a cache: DenseFormer's DWA over the cached block outputs, MoDA's depth entries of one token,
# AttnRes's block sums, mHC's streams of one token.
DECODE_VARIANTS = [f"{family}-{CASES[family].compiled_generate}" for family in causal_lm_families()]


@pytest.mark.parametrize("name", DECODE_VARIANTS)
def test_compiled_forward_and_generate_match_eager(name):
    """A compiled model decoding on a cache (prefill, then one-token steps; the first call it compiles) gives the
    eager logits at every step; then ``model.forward = torch.compile(model.forward)`` (the transformers recipe):
    a forward without gradients gives the eager logits, and greedy ``generate`` with left padding the same
    tokens and scores."""
    model = float64_model(name).eval()
    compiled = torch.compile(model, backend="aot_eager")
    prompt = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    caches = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        for start, stop in [(0, 6), (6, 7), (7, 8), (8, 9)]:
            want = model(input_ids=prompt[:, start:stop], cache=caches[0], use_cache=True).logits
            got = compiled(input_ids=prompt[:, start:stop], cache=caches[1], use_cache=True).logits
            assert_close(got, want, f"cached logits of tokens {start}:{stop}")
    assert caches[1].get_seq_length() == prompt.shape[1]

    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # left padding
    config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)

    def run():
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        return logits, model.generate(ids, attention_mask=mask, generation_config=config, output_scores=True,
                                      return_dict_in_generate=True)

    want_logits, want = run()
    model.forward = torch.compile(model.forward, backend="aot_eager")
    got_logits, got = run()
    assert_close(got_logits, want_logits, "forward")
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == 5
    for step, (a, b) in enumerate(zip(got.scores, want.scores)):
        assert_close(a, b, f"scores of new token {step}")


@pytest.mark.parametrize("fusion", ["dwatt", "concat"])
def test_compiled_dwatt_matches_eager(fusion):
    """DWAtt (a BERT encoder with a depth-fusion head) compiled: the loss and every gradient of a padded,
    labelled batch, and the logits without gradients, equal the eager model's (dropout off: compiled and eager
    draw different random masks)."""
    from .dwatt.helpers import tiny_model

    torch.manual_seed(0)
    eager = tiny_model(fusion).double().train()
    with torch.no_grad():
        for p in eager.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for module in eager.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    eager.config.backbone_config.attention_probs_dropout_prob = 0.0
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(5, eager.config.backbone_config.vocab_size, (2, 9), generator=gen)
    labels = torch.randint(0, eager.config.num_labels, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 7:], labels[0, 7:] = 0, -100
    want = eager(input_ids=ids, attention_mask=mask, labels=labels).loss
    want.backward()
    got = compiled(input_ids=ids, attention_mask=mask, labels=labels).loss
    got.backward()
    assert_close(got.detach(), want.detach(), "loss")
    for (n, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        if p.grad is not None:
            assert_close(q.grad, p.grad, f"gradient of {n}")
    eager.eval()
    with torch.no_grad():
        assert_close(compiled(input_ids=ids, attention_mask=mask).logits,
                     eager(input_ids=ids, attention_mask=mask).logits, "logits")
