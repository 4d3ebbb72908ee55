"""``torch.compile`` of an mHC model gives the eager model's numbers (float64, ``aot_eager`` as in
tests/test_torch_compile.py): training over two SGD steps (loss and every gradient), cached decoding on a compiled
model, and greedy ``generate`` with left padding with a compiled forward."""

import copy

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from depthfusion_hf.models.mhc import MHCForCausalLM

from .helpers import EPS, randomise_mhc, tiny_config

EPS64 = EPS[torch.float64]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def float64_model() -> MHCForCausalLM:
    torch.manual_seed(0)
    return randomise_mhc(MHCForCausalLM(tiny_config(num_hidden_layers=2, hc_sinkhorn_iters=3))).double()


def assert_close(got, want, what):
    scale = want.abs().max().clamp_min(1.0)
    err = (got - want).abs().max()
    assert err <= 64 * EPS64 * scale, f"{what}: max |diff| {err.item():.3g} over scale {scale.item():.3g}"


@pytest.mark.parametrize("backend", ["torch"])
def test_compiled_training_matches_eager(backend):
    eager = float64_model().train()
    eager.config.op_backend = backend
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, compiled_model)]
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        ids = torch.randint(3, 97, (2, 10), generator=gen)
        want = eager(input_ids=ids, labels=ids).loss
        want.backward()
        got = compiled(input_ids=ids, labels=ids).loss
        got.backward()
        assert_close(got.detach(), want.detach(), f"loss at step {step}")
        for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            assert q.grad is not None, f"{name}: no gradient through the compiled model"
            assert_close(q.grad, p.grad, f"gradient of {name} at step {step}")
        for optimiser in optimisers:
            optimiser.step()
            optimiser.zero_grad()


def test_compiled_forward_and_generate_match_eager():
    model = float64_model().eval()
    compiled = torch.compile(model, backend="aot_eager")
    prompt = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    caches = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        for start, stop in [(0, 6), (6, 7), (7, 8), (8, 9)]:
            want = model(input_ids=prompt[:, start:stop], cache=caches[0], use_cache=True).logits
            got = compiled(input_ids=prompt[:, start:stop], cache=caches[1], use_cache=True).logits
            assert_close(got, want, f"cached logits of tokens {start}:{stop}")
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
    for step, (a, b) in enumerate(zip(got.scores, want.scores)):
        assert_close(a, b, f"scores of new token {step}")
