"""Adversarial review of MoDA's fast paths against the reference path.

Fast paths under test: the slot-major depth stream (training and prefill), the block-diagonal entry-gradient
product, the bmm-vs-broadcast depth products, and the buffer-free one-token decode step (one SDPA call over
[sequence | depth], the four-op FFN key rotation). The reference is the tuple-and-stack path with the
``reference`` backend (loops over batch, head, token; plain autograd), in float64 where the input allows,
so that every difference is rounding: tolerances are ``k * eps(dtype) * max|value|``.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from transformers import DynamicCache, GenerationConfig, StaticCache

from depthfusion_hf.models.moda.depth_stream import DepthStream

from .helpers import tiny_model

depth_stream_module = importlib.import_module("depthfusion_hf.models.moda.depth_stream")
F64 = torch.float64


@contextlib.contextmanager
def reference_path(model, monkeypatch):
    """Inside: every forward of ``model`` runs the tuple-and-stack path on the ``reference`` backend."""
    with monkeypatch.context() as patch:
        patch.setenv("DEPTHFUSION_BACKEND", "reference")
        patch.setattr(model.model, "uses_depth_stream", lambda *args: False)
        yield


@contextlib.contextmanager
def fast_path(monkeypatch):
    """Inside: the ``torch`` backend (the stream's own CPU path) whatever the environment says."""
    with monkeypatch.context() as patch:
        patch.setenv("DEPTHFUSION_BACKEND", "torch")
        yield


def close(a: torch.Tensor, b: torch.Tensor, factor: float = 64.0, scale: float | None = None) -> None:
    """Equal up to a different summation order: ``factor`` eps of the largest magnitude involved (at least 1)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    eps = torch.finfo(a.dtype).eps
    if scale is None:
        scale = max(a.abs().max().item(), b.abs().max().item(), 1.0)
    torch.testing.assert_close(a, b, rtol=0, atol=factor * eps * scale)


def count_calls(monkeypatch, name: str) -> list:
    """Record each call of ``DepthStream.<name>`` (the real method still runs)."""
    calls = []
    real = getattr(DepthStream, name)

    def spy(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DepthStream, name, spy)
    return calls


def cloned(cache: DynamicCache, config) -> DynamicCache:
    """A fresh DynamicCache holding copies of ``cache``'s keys and values (each run extends its own)."""
    copy = DynamicCache(config=config)
    for layer, entry in enumerate(cache.layers):
        copy.update(entry.keys.clone(), entry.values.clone(), layer)
    return copy


def forward_backward(model, inputs: dict, wrt: dict[str, torch.Tensor]):
    """Logits and the gradients of a fixed random projection of them w.r.t. ``wrt`` (first order)."""
    logits = model(**inputs).logits
    torch.manual_seed(7)
    probe = torch.randn(logits.shape, dtype=logits.dtype)
    grads = torch.autograd.grad((logits * probe).sum(), list(wrt.values()), allow_unused=True)
    return logits.detach(), dict(zip(wrt, grads))


def assert_forward_backward_matches(model, inputs, monkeypatch, wrt=None, factor=256.0):
    wrt = wrt if wrt is not None else {n: p for n, p in model.named_parameters() if p.requires_grad}
    with fast_path(monkeypatch):
        logits, grads = forward_backward(model, inputs, wrt)
    with reference_path(model, monkeypatch):
        ref_logits, ref_grads = forward_backward(model, inputs, wrt)
    close(logits, ref_logits, factor)
    for name, ref in ref_grads.items():
        got = grads[name]
        assert (got is None) == (ref is None), name
        if ref is not None:
            close(got, ref, factor)
    return grads


# ---- one-token prompts and cached decoding -------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_key_value_heads": 1}, {"num_key_value_heads": 4}, {"moda_ffn_kv": False},
     {"moda_depth_window": 1}, {"moda_depth_window": 4}, {"num_hidden_layers": 1}],
)
def test_one_token_prompt_takes_the_decode_step_and_equals_the_reference(monkeypatch, overrides, batch):
    model = tiny_model(seed=4, **overrides).to(F64)
    ids = torch.randint(3, 97, (batch, 1))
    steps = count_calls(monkeypatch, "decode_step")
    with torch.no_grad(), fast_path(monkeypatch):
        fast = model(ids).logits
    assert len(steps) == model.config.num_hidden_layers  # T = 1, no cache, no mask: the buffer-free step
    assert all(stream.keys is None for stream in steps)
    with torch.no_grad(), reference_path(model, monkeypatch):
        ref = model(ids).logits
    close(fast, ref)


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 1}, {"moda_depth_window": 1}])
def test_cached_decode_steps_equal_the_reference_with_outputs(monkeypatch, overrides):
    """Prefill, then one-token steps with output_attentions and output_hidden_states (float64)."""
    model = tiny_model(seed=5, **overrides).to(F64)
    ids = torch.randint(3, 97, (2, 8))
    results = []
    for context in (fast_path, lambda mp: reference_path(model, mp)):
        with torch.no_grad(), context(monkeypatch):
            cache = DynamicCache(config=model.config)
            outs = [model(ids[:, :5], cache=cache, use_cache=True)]
            for t in range(5, 8):
                outs.append(model(ids[:, t:t + 1], cache=cache, use_cache=True, output_attentions=True,
                                  output_hidden_states=True))
        results.append(outs)
    for fast, ref in zip(*results):
        close(fast.logits, ref.logits)
        for a, b in zip(fast.attentions or (), ref.attentions or ()):
            close(a, b)
        for a, b in zip(fast.hidden_states or (), ref.hidden_states or ()):
            close(a, b)
    assert len(results[0][-1].attentions) == model.config.num_hidden_layers


@pytest.mark.parametrize("trainable", ["all", "none"])
def test_decode_step_with_gradients_enabled_equals_the_reference(monkeypatch, trainable):
    """A one-token step with autograd on: the stream tracks it (buffers, no SDPA shortcut) or, with every
    parameter frozen, runs the decode step on the buffer; logits and gradients equal the reference."""
    model = tiny_model(seed=6).to(F64).train()
    if trainable == "none":
        model.requires_grad_(False)
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        prefix = model(ids[:, :6], use_cache=True).cache

    def inputs():
        return {"input_ids": ids[:, 6:], "cache": cloned(prefix, model.config), "use_cache": True}

    embeds = None
    wrt = None
    if trainable == "none":  # gradients w.r.t. the input embeddings only
        embeds = model.model.embed_tokens(ids[:, 6:]).detach().requires_grad_(True)
        wrt = {"embeds": embeds}

    def run_inputs():
        args = inputs()
        if embeds is not None:
            args = {**args, "input_ids": None, "inputs_embeds": embeds}
        return args

    with fast_path(monkeypatch):
        logits, grads = forward_backward(model, run_inputs(), wrt or dict(model.named_parameters()))
    with reference_path(model, monkeypatch):
        ref_logits, ref_grads = forward_backward(model, run_inputs(), wrt or dict(model.named_parameters()))
    close(logits, ref_logits, 256)
    for name, ref in ref_grads.items():
        if ref is None:
            assert grads[name] is None, name
        else:
            close(grads[name], ref, 256)


def test_frozen_model_one_token_step_with_grad_mode_on_uses_the_decode_step(monkeypatch):
    """Grad mode on, nothing requires grad: the stream (kept entries, no buffer) runs the decode step."""
    model = tiny_model(seed=6).to(F64).requires_grad_(False)
    ids = torch.randint(3, 97, (2, 6))
    steps = count_calls(monkeypatch, "decode_step")
    with fast_path(monkeypatch):
        cache = model(ids[:, :5], use_cache=True).cache
        fast = model(ids[:, 5:], cache=cache, use_cache=True).logits
    assert steps and all(stream.keys is None and stream.track_grad for stream in steps)
    with torch.no_grad(), reference_path(model, monkeypatch):
        ref = model(ids).logits[:, -1:]
    close(fast, ref)


# ---- generate(): greedy, sampling, beam search, left padding, static cache -------------------------------


def generate(model, ids, mask=None, **kwargs):
    config = GenerationConfig(max_new_tokens=5, pad_token_id=0, eos_token_id=None, **kwargs)
    torch.manual_seed(11)
    return model.generate(ids, attention_mask=mask, generation_config=config, output_scores=True,
                          return_dict_in_generate=True)


@pytest.mark.parametrize(
    "mode",
    [dict(do_sample=False), dict(do_sample=True, top_k=20), dict(num_beams=3, do_sample=False),
     dict(num_beams=2, do_sample=True, num_return_sequences=2)],
    ids=["greedy", "sample", "beam", "beam_sample"],
)
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_generate_equals_the_reference(monkeypatch, mode, padding, batch):
    model = tiny_model(seed=8).to(F64)
    ids = torch.randint(3, 97, (batch, 6))
    mask = None
    if padding:
        mask = torch.ones_like(ids)
        mask[-1, :3] = 0  # left padding of the last sequence (the only one when B = 1)
        ids = ids.masked_fill(mask == 0, 0)
    with fast_path(monkeypatch):
        fast = generate(model, ids, mask, **mode)
    with reference_path(model, monkeypatch):
        ref = generate(model, ids, mask, **mode)
    assert torch.equal(fast.sequences, ref.sequences)
    for a, b in zip(fast.scores, ref.scores):
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite)
        close(a[finite], b[finite])


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("prompt", [1, 4])
@pytest.mark.parametrize("batch", [1, 2])
def test_static_cache_decoding_equals_the_reference(monkeypatch, batch, prompt, implementation):
    """A StaticCache hands back all max_cache_len keys. For a prefill into the empty cache transformers leaves the
    sdpa mask out (meaning SDPA's top-left causal alignment), which moda_attention read bottom-right: every
    prefill logit was wrong on every path. One-token prompts and decode steps get a mask (the unfilled keys)."""
    model = tiny_model(seed=9, attn_implementation=implementation).to(F64)
    ids = torch.randint(3, 97, (batch, 7))
    with torch.no_grad(), reference_path(model, monkeypatch):
        ref = model(ids).logits
    for context in (fast_path, lambda mp: reference_path(model, mp)):
        with torch.no_grad(), context(monkeypatch):
            cache = StaticCache(config=model.config, max_cache_len=16)
            steps = [model(ids[:, :prompt], cache=cache, use_cache=True).logits]
            for t in range(prompt, 7):
                steps.append(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits)
        close(torch.cat(steps, dim=1), ref)


def test_generate_with_a_static_cache_equals_the_reference(monkeypatch):
    model = tiny_model(seed=9).to(F64)
    ids = torch.randint(3, 97, (2, 5))
    with fast_path(monkeypatch):
        fast = generate(model, ids, cache_implementation="static")
    with reference_path(model, monkeypatch):
        ref = generate(model, ids)
    assert torch.equal(fast.sequences, ref.sequences)
    for a, b in zip(fast.scores, ref.scores):
        close(a, b)


# ---- training-side fast paths ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{"moda_depth_window": 1}, {"moda_depth_window": 3}, {"moda_depth_window": 4},
     {"moda_depth_window": 1, "moda_ffn_kv": False}, {"num_key_value_heads": 1}, {"num_key_value_heads": 4},
     {"num_hidden_layers": 1}, {"num_hidden_layers": 2, "moda_depth_window": 2},
     {"head_dim": 34, "num_key_value_heads": 1}],  # G M d straddles the bmm threshold between layers
)
@pytest.mark.parametrize("batch", [1, 2])
def test_training_stream_equals_the_reference(monkeypatch, overrides, batch):
    model = tiny_model(seed=10, **overrides).to(F64).train()
    ids = torch.randint(3, 97, (batch, 5))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    reads = count_calls(monkeypatch, "fast_forward")
    assert_forward_backward_matches(model, {"input_ids": ids, "attention_mask": mask}, monkeypatch)
    assert reads  # the stream's own CPU path ran


def test_training_with_a_cached_prefix_equals_the_reference(monkeypatch):
    """T > 1 new tokens after a cached prefix (S > T: bottom-right causal mask), gradients on."""
    model = tiny_model(seed=12).to(F64).train()
    ids = torch.randint(3, 97, (2, 8))
    with torch.no_grad():
        prefix = model(ids[:, :5], use_cache=True).cache

    def inputs():
        return {"input_ids": ids[:, 5:], "cache": cloned(prefix, model.config), "use_cache": True}

    wrt = dict(model.named_parameters())
    with fast_path(monkeypatch):
        logits, grads = forward_backward(model, inputs(), wrt)
    with reference_path(model, monkeypatch):
        ref_logits, ref_grads = forward_backward(model, inputs(), wrt)
    close(logits, ref_logits, 256)
    for name, ref in ref_grads.items():
        close(grads[name], ref, 256)


def test_non_contiguous_inputs_embeds_gradients_equal_the_reference(monkeypatch):
    model = tiny_model(seed=13).to(F64).train().requires_grad_(False)
    base = torch.randn(6, 2, 48, dtype=F64)
    embeds = base.transpose(0, 1).requires_grad_(True)  # (B, T, D), not contiguous
    assert not embeds.is_contiguous()
    assert_forward_backward_matches(model, {"inputs_embeds": embeds}, monkeypatch, wrt={"embeds": embeds})


def test_gradient_checkpointing_equals_the_reference(monkeypatch):
    """Checkpointed layers (non-reentrant, the default) take the tuple path: same loss and gradients."""
    model = tiny_model(seed=14).to(F64).train()
    ids = torch.randint(3, 97, (2, 6))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    with reference_path(model, monkeypatch):
        ref_logits, ref_grads = loss_and_grads()
    model.activation_checkpointing_enable()
    with fast_path(monkeypatch):
        logits, grads = loss_and_grads()
    close(logits, ref_logits, 256)
    for name, ref in ref_grads.items():
        close(grads[name], ref, 256)


# Reentrant checkpointing (use_reentrant=True) computes exact gradients: tests/moda/test_reentrant_checkpointing.py.


SECOND_ORDER_ERROR = "first-order gradients only; got a backward with create_graph=True"


def test_double_backward_through_the_stream_is_rejected_and_the_advice_works(monkeypatch):
    """A gradient of a gradient: the stream's Functions are first order only. ``once_differentiable`` alone let
    ``torch.autograd.grad`` prune its error node and return second-order gradients without the stream's terms
    (a silently wrong number); the stream now refuses create_graph=True, and the route its message names
    (DEPTHFUSION_BACKEND=reference: the tuple path) computes them."""
    model = tiny_model(seed=15).to(F64).train()
    ids = torch.randint(3, 97, (2, 5))
    params = dict(model.named_parameters())

    def second_order():
        loss = model(ids, labels=ids).loss
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        penalty = sum((g * g).sum() for g in grads)
        return torch.autograd.grad(penalty, list(params.values()), allow_unused=True)

    with fast_path(monkeypatch), pytest.raises(RuntimeError, match=SECOND_ORDER_ERROR):
        second_order()
    with monkeypatch.context() as patch:
        patch.setenv("DEPTHFUSION_BACKEND", "reference")  # no other switch: the advice alone must work
        advised = second_order()
    with reference_path(model, monkeypatch):
        ref = second_order()
    for name, a, b in zip(params, advised, ref):
        assert b is not None and b.abs().max() > 0, name
        close(a, b, 64)


@pytest.mark.parametrize("reach", ["ffn_entry", "embeddings"])
def test_second_order_through_the_entries_only_is_rejected(monkeypatch, reach):
    """Second order w.r.t. a tensor whose gradient involves the depth entries' gradients (the writer's side)."""
    model = tiny_model(seed=16).to(F64).train()
    ids = torch.randint(3, 97, (2, 5))
    if reach == "ffn_entry":
        target, inputs = model.model.layers[0].ffn_kv_proj.weight, {"input_ids": ids}
    else:
        model.requires_grad_(False)
        target = model.model.embed_tokens(ids).detach().requires_grad_(True)
        inputs = {"inputs_embeds": target}
    with fast_path(monkeypatch), pytest.raises(RuntimeError, match=SECOND_ORDER_ERROR):
        logits = model(**inputs).logits
        torch.autograd.grad(logits.square().sum(), [target], create_graph=True)


def test_model_cast_to_float64_between_calls(monkeypatch):
    model = tiny_model(seed=17)
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad(), fast_path(monkeypatch):
        model(ids)  # a float32 pass first
        model.to(torch.float64)
        cache = model(ids[:, :5], use_cache=True).cache
        step = model(ids[:, 5:], cache=cache, use_cache=True).logits
        full = model(ids).logits
    assert full.dtype == F64
    with torch.no_grad(), reference_path(model, monkeypatch):
        ref = model(ids).logits
    close(full, ref)
    close(step, ref[:, -1:])
    model.train()
    assert_forward_backward_matches(model, {"input_ids": ids}, monkeypatch)


@pytest.mark.parametrize("training", [False, True])
def test_bfloat16_stream_is_as_close_to_float64_as_the_bf16_reference(monkeypatch, training):
    """bf16 takes the generic (non-fast) stream path; its error against float64 must be of the size of the
    bf16 tuple path's (fp32 accumulation in both), not larger."""
    model = tiny_model(seed=18).to(F64).train(training)
    ids = torch.randint(3, 97, (2, 6))
    wrt = dict(model.named_parameters())
    with reference_path(model, monkeypatch):
        exact, exact_grads = forward_backward(model, {"input_ids": ids}, wrt)
    model.to(torch.bfloat16)
    wrt = dict(model.named_parameters())
    with fast_path(monkeypatch):
        fast, fast_grads = forward_backward(model, {"input_ids": ids}, wrt)
    with fast_path(monkeypatch), monkeypatch.context() as patch:
        patch.setattr(model.model, "uses_depth_stream", lambda *args: False)
        tuple_path, tuple_grads = forward_backward(model, {"input_ids": ids}, wrt)

    def error(a, b):
        return (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-30)

    assert error(fast, exact) <= 2 * error(tuple_path, exact) + 4 * torch.finfo(torch.bfloat16).eps
    for name, ref in exact_grads.items():
        bound = 2 * error(tuple_grads[name], ref) + 4 * torch.finfo(torch.bfloat16).eps
        assert error(fast_grads[name], ref) <= bound, name


def test_peft_lora_on_one_ffn_projection_equals_the_reference(monkeypatch):
    peft = pytest.importorskip("peft")
    model = tiny_model(seed=19).to(F64)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["layers.1.ffn_kv_proj"],
                                                      init_lora_weights=False))
    lora.train()
    ids = torch.randint(3, 97, (2, 6))
    trainable = {n: p for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("ffn_kv_proj" in n for n in trainable)
    base = lora.base_model.model  # the MoDAForCausalLM that reference_path patches
    with fast_path(monkeypatch):
        logits, grads = forward_backward(lora, {"input_ids": ids}, trainable)
    with reference_path(base, monkeypatch):
        ref_logits, ref_grads = forward_backward(lora, {"input_ids": ids}, trainable)
    close(logits, ref_logits, 256)
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0
        close(grads[name], ref, 256)


# ---- the depth-product helpers at the edges -------------------------------------------------------------


@pytest.mark.parametrize("group,entries,head_dim", [(1, 1, 2), (4, 1, 100), (1, 200, 2), (3, 7, 19), (2, 5, 40)])
def test_depth_products_at_the_edges(group, entries, head_dim):
    """One-entry windows, many entries, G > 1, odd head sizes, entries with strided rows."""
    tokens = 5
    buffer = torch.randn(tokens, entries + 1, head_dim, dtype=F64)
    slots = list(buffer[:, 1:].unbind(1))  # M entries [N, d], rows of stride (M + 1) d
    stacked = torch.stack(slots)
    x = torch.randn(tokens, group, head_dim, dtype=F64)
    dots = depth_stream_module._depth_dots(x, slots, torch.empty(entries, tokens, group, dtype=F64))
    expected = torch.einsum("ngd,mnd->mng", x, stacked)
    close(dots, expected, 4 * head_dim, scale=(x.abs().max() * stacked.abs().max()).item())
    weights = torch.randn(entries, tokens, group, dtype=F64)
    mixed = depth_stream_module._depth_mix(weights, slots, torch.zeros(tokens, group, head_dim, dtype=F64))
    close(mixed, torch.einsum("mng,mnd->ngd", weights, stacked), 4 * entries,
          scale=(weights.abs().max() * stacked.abs().max()).item())


def test_second_backward_reaching_only_the_first_layers_equals_the_reference(monkeypatch):
    """Two backwards through one retained graph: the second starts at layer 1's output, so the later readers'
    backward does not run; their output-gradient rows from the first backward must not leak into it."""
    model = tiny_model(seed=20).to(F64).train()
    ids = torch.randint(3, 97, (2, 6))
    params = dict(model.named_parameters())
    torch.manual_seed(3)
    probe = torch.randn(2, 6, 48, dtype=F64)

    def two_backwards():
        out = model(ids, labels=ids, output_hidden_states=True)
        torch.autograd.grad(out.loss, list(params.values()), retain_graph=True, allow_unused=True)
        partial = (out.hidden_states[2] * probe).sum()  # the output of layer 1
        return torch.autograd.grad(partial, list(params.values()), allow_unused=True)

    with fast_path(monkeypatch):
        got = two_backwards()
    with reference_path(model, monkeypatch):
        ref = two_backwards()
    assert ref[list(params).index("model.layers.0.ffn_kv_proj.weight")].abs().max() > 0
    for name, a, b in zip(params, got, ref):
        assert (a is None) == (b is None), name
        if b is not None:
            close(a, b, 256)
