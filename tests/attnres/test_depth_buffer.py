"""The no-gradient path for few tokens (cached decoding): the sources and every call's logits in a DepthBuffer.

Every check compares the model on that path with the reference backend (the loop over sources) in float64,
or checks that the path is taken, reused between forwards, and left where it cannot compute the op exactly.
Gate: the calls agree to float64 rounding (the same terms summed in other orders: measured 3.5 eps64 in the
softmax weights), but transformers' Llama RMSNorms compute in float32 even in a float64 model, so a rounding
difference can flip a float32 rounding inside the next sub-layer: logits and weights are compared to
``64 eps32`` (times the logits' scale), far below any change of the function.
"""

from __future__ import annotations

import threading

import pytest
import torch

from depthfusion_hf.models.attnres import AttnResForCausalLM, attnres, depth_buffer
from depthfusion_hf.models.attnres.depth_buffer import DepthBuffer, acquire_depth_buffer, uses_depth_buffer

from .helpers import randomise_attnres, tiny_config

EPS32 = torch.finfo(torch.float32).eps


def float64_model(block_size, seed=0) -> AttnResForCausalLM:
    torch.manual_seed(seed)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=block_size)).double().eval()
    randomise_attnres(model, seed=seed)
    return model


def run(model, ids, backend, monkeypatch, **kwargs):
    """Logits [B, T, V] and every call's softmax weights of one no-grad forward on ``backend``."""
    monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
    with torch.no_grad():
        out = model.model(ids, use_cache=False, output_depth_weights=True, **kwargs)
        return model.lm_head(out.last_hidden_state), out.depth_weights


@pytest.fixture
def buffer_calls(monkeypatch):
    """Counts the calls that the buffer computes itself and those it hands to the torch backend."""
    counts = {"mix": 0, "fallback": 0}
    mix, fallback = DepthBuffer.mix, depth_buffer.attention_residual_with_backend

    def counting_mix(self, *args, **kwargs):
        counts["mix"] += 1
        return mix(self, *args, **kwargs)

    def counting_fallback(*args, **kwargs):
        counts["fallback"] += 1
        return fallback(*args, **kwargs)

    monkeypatch.setattr(DepthBuffer, "mix", counting_mix)
    monkeypatch.setattr(depth_buffer, "attention_residual_with_backend", counting_fallback)
    return counts


def assert_close_to_reference(logits, weights, ref_logits, ref_weights):
    scale = ref_logits.abs().max()
    assert (logits - ref_logits).abs().max() <= 64 * EPS32 * scale
    assert len(weights) == len(ref_weights)
    for alpha, ref in zip(weights, ref_weights):
        assert alpha.shape == ref.shape and alpha.dtype == ref.dtype
        assert (alpha - ref).abs().max() <= 64 * EPS32


@pytest.mark.parametrize("block_size", [None, 1, 3, 5, 8], ids=lambda s: f"block{s}")
@pytest.mark.parametrize("shape", [(1, 1), (1, 6), (3, 4)], ids=lambda s: f"B{s[0]}T{s[1]}")
def test_buffer_matches_reference_backend(block_size, shape, monkeypatch, buffer_calls):
    """Logits and every call's weights on the buffer path (one token: matrix-vector products; more: batched)
    equal the reference loop's; every call is computed by the buffer itself (no fallback)."""
    model = float64_model(block_size)
    ids = torch.randint(3, 97, shape, generator=torch.Generator().manual_seed(1))
    ref_logits, ref_weights = run(model, ids, "reference", monkeypatch)
    assert buffer_calls["mix"] == 0
    logits, weights = run(model, ids, "torch", monkeypatch)
    assert buffer_calls["mix"] == 2 * model.config.num_hidden_layers
    assert buffer_calls["fallback"] == 0
    assert_close_to_reference(logits, weights, ref_logits, ref_weights)


@pytest.mark.parametrize("through_data", [False, True], ids=["in_place", "through_data"])
def test_buffer_is_reused_and_follows_parameter_updates(monkeypatch, through_data):
    """The buffer of one forward serves the next (same shape); the keys are retaken every forward, so an
    update of a pseudo-query between forwards changes the result as on the reference backend, also one made
    through ``.data`` (which bumps no version counter: a key kept from the last forward would be stale)."""
    model = float64_model(3)
    gen = torch.Generator().manual_seed(2)
    ids_a, ids_b = torch.randint(3, 97, (1, 1), generator=gen), torch.randint(3, 97, (1, 1), generator=gen)
    run(model, ids_a, "torch", monkeypatch)
    pool = list(attnres_pool(model))
    assert len(pool) == 1 and not pool[0].lock.locked()
    query = model.model.layers[1].mlp_res.query
    with torch.no_grad():
        (query.data if through_data else query).mul_(-2.0)
    logits, weights = run(model, ids_b, "torch", monkeypatch)
    assert list(attnres_pool(model)) == pool  # the same buffer, released again
    assert not pool[0].lock.locked()
    assert_close_to_reference(logits, weights, *run(model, ids_b, "reference", monkeypatch))


def attnres_pool(model):
    from depthfusion_hf.models.attnres.modeling_attnres import DEPTH_BUFFERS

    return DEPTH_BUFFERS.get(model.model, [])


def test_a_wider_query_falls_back_to_the_torch_backend(monkeypatch, buffer_calls):
    """A float64 pseudo-query in a float32 model raises the compute dtype above the buffer's: every call then
    runs the torch backend over views of the buffer's sources, in float64 like the reference."""
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=None)).eval()
    randomise_attnres(model)
    mix = model.model.layers[2].output_res
    mix.query = torch.nn.Parameter(mix.query.detach().double())
    ids = torch.randint(3, 97, (2, 3), generator=torch.Generator().manual_seed(3))
    ref_logits, ref_weights = run(model, ids, "reference", monkeypatch)
    logits, weights = run(model, ids, "torch", monkeypatch)
    assert buffer_calls["fallback"] == 2 * model.config.num_hidden_layers
    assert (logits - ref_logits).abs().max() <= 256 * EPS32 * ref_logits.abs().max()  # float32 sources
    for alpha, ref in zip(weights, ref_weights):
        assert alpha.dtype == ref.dtype
        assert (alpha - ref).abs().max() <= 256 * EPS32


def test_a_replaced_call_module_falls_back_for_that_call(monkeypatch, buffer_calls):
    """A call whose parameters are not those the keys were taken from (e.g. a wrapper swapped in after the keys
    were read) is computed by the torch backend from its own parameters."""
    model = float64_model(None)
    ids = torch.randint(3, 97, (1, 2), generator=torch.Generator().manual_seed(4))
    mix = model.model.layers[1].mlp_res
    other = type(mix)(mix.query.numel(), mix.eps).double()
    with torch.no_grad():
        other.query.copy_(-mix.query)
        other.key_norm_weight.copy_(mix.key_norm_weight)
    original_start = DepthBuffer.start

    def start_then_swap(self, *args):
        original_start(self, *args)
        model.model.layers[1].mlp_res = other

    monkeypatch.setattr(DepthBuffer, "start", start_then_swap)
    logits, weights = run(model, ids, "torch", monkeypatch)
    assert buffer_calls["fallback"] == 1
    monkeypatch.setattr(DepthBuffer, "start", original_start)
    assert_close_to_reference(logits, weights, *run(model, ids, "reference", monkeypatch))


def test_when_the_buffer_is_used():
    """Only the torch backend, without gradients, for few elements, float32/float64, without autocast."""
    small = torch.zeros(1, 1, 8)
    with torch.no_grad():
        assert uses_depth_buffer("torch", small)
        assert uses_depth_buffer("torch", small.double())
        assert not uses_depth_buffer("reference", small)
        assert not uses_depth_buffer("triton", small)
        assert not uses_depth_buffer("torch", small.bfloat16())
        assert not uses_depth_buffer("torch", torch.zeros(1, attnres.SMALL_NUMEL + 1, 1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not uses_depth_buffer("torch", small)
    assert not uses_depth_buffer("torch", small)  # gradients enabled


def test_a_buffer_in_use_is_not_shared():
    """A forward gets a free buffer of its shape; while one is in use (another thread) a second one is made."""
    first = torch.zeros(1, 1, 4)
    pool: list[DepthBuffer] = []
    a = acquire_depth_buffer(pool, first, 5, 4, 1e-6)
    b = acquire_depth_buffer(pool, first, 5, 4, 1e-6)
    assert a is not b and a.lock.locked() and b.lock.locked()
    a.lock.release()
    assert acquire_depth_buffer(pool, first, 5, 4, 1e-6) is a
    assert acquire_depth_buffer(pool, torch.zeros(2, 1, 4), 5, 4, 1e-6) not in (a, b)  # another shape


def test_concurrent_forwards_give_their_own_results(monkeypatch):
    """Two threads decoding with one model at once get the same logits as one after the other."""
    model = float64_model(3)
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randint(3, 97, (1, 1), generator=gen) for _ in range(8)]
    expected = [run(model, ids, "torch", monkeypatch)[0] for ids in inputs]
    results: dict[int, list[torch.Tensor]] = {}

    def work(k):
        with torch.no_grad():
            results[k] = [model(ids, use_cache=False).logits for ids in inputs for _ in range(5)]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(2):
        for i, logits in enumerate(results[k]):
            assert torch.equal(logits, expected[i // 5])


def test_an_error_inside_a_forward_releases_the_buffer(monkeypatch):
    """A layer raising mid-forward leaves the buffer free for the next forward."""
    model = float64_model(None)
    ids = torch.randint(3, 97, (1, 1), generator=torch.Generator().manual_seed(6))
    run(model, ids, "torch", monkeypatch)
    original = type(model.model.layers[2]).forward

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(type(model.model.layers[2]), "forward", fail)
    with pytest.raises(RuntimeError, match="boom"):
        run(model, ids, "torch", monkeypatch)
    monkeypatch.setattr(type(model.model.layers[2]), "forward", original)
    assert all(not b.lock.locked() for b in attnres_pool(model))
