"""MoDA under torch.compile: the one-token StaticCache decoding step compiles whole, once, and decodes greedily
token for token as eager does (issue 21, with left padding); a compiled training step equals the eager one."""

import pytest
import torch

from tests.compiled_decoding import assert_compiled_decoding_matches_eager

from .helpers import tiny_model

# FFN-side entries on and off (off: layer 1 reads one key and one value, a pair of entries that torch.compile 2.13
# mis-binds in an autograd.Function called under no_grad); the window and norm position change no operator.
VARIANTS = [{}, {"moda_ffn_kv": False}]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_compiled_static_cache_decoding_matches_eager(overrides):
    result = assert_compiled_decoding_matches_eager(tiny_model(seed=3, num_hidden_layers=2, **overrides))
    assert result.graphs == 1


def test_compiled_training_step_equals_eager():
    """fullgraph: the forward (mask, RoPE, the op's dispatch and custom Function) and its backward in one graph."""
    model = tiny_model(seed=5, num_hidden_layers=3, moda_ffn_kv=False).train()
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0

    def step(run):
        model.zero_grad()
        loss = run(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    torch._dynamo.reset()
    try:
        want_loss, want_grads = step(model)
        got_loss, got_grads = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
