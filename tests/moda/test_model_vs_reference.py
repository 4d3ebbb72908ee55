"""The MoDA model on its PyTorch backend against the same model on the ``reference`` backend (the paper's loop,
plain autograd), in float64 so that every difference is rounding (tolerances ``k * eps * max|value|``): training
(with and without padding, which take the op's fused-CPU and materialised sequence pools), cached decoding,
``generate``, static caches, gradient checkpointing (transformers' and ``torch.utils.checkpoint`` applied to a
layer from outside, reentrant or not), second-order gradients, PEFT, bf16 / fp16 autocast, ``inference_mode``.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, GenerationConfig, StaticCache

from depthfusion_hf.models.transformers_compat import output_cache

from .helpers import tiny_model

F64 = torch.float64


@contextlib.contextmanager
def on(backend: str, monkeypatch):
    """Inside: every forward of every model runs the op on ``backend``."""
    with monkeypatch.context() as patch:
        patch.setenv("DEPTHFUSION_BACKEND", backend)
        yield


def close(a: torch.Tensor, b: torch.Tensor, factor: float = 64.0) -> None:
    """Equal up to a different summation order: ``factor`` eps of the largest magnitude involved (at least 1)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    scale = max(a.abs().max().item(), b.abs().max().item(), 1.0)
    torch.testing.assert_close(a, b, rtol=0, atol=factor * torch.finfo(a.dtype).eps * scale)


def forward_backward(model, inputs: dict, wrt: dict[str, torch.Tensor]):
    """Logits and the gradients of a fixed random projection of them w.r.t. ``wrt`` (None where unused)."""
    logits = model(**inputs).logits
    probe = torch.randn(logits.shape, dtype=logits.dtype, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad((logits * probe).sum(), list(wrt.values()), allow_unused=True)
    return logits.detach(), dict(zip(wrt, grads))


def assert_matches_reference(model, inputs, monkeypatch, wrt=None, factor=256.0, prepare=lambda: None):
    """``inputs`` may be a callable (a fresh dict per run, e.g. with a cloned cache)."""
    wrt = wrt if wrt is not None else {n: p for n, p in model.named_parameters() if p.requires_grad}
    results = []
    for backend in ("torch", "reference"):
        with on(backend, monkeypatch):
            prepare()
            results.append(forward_backward(model, inputs() if callable(inputs) else inputs, wrt))
    (logits, grads), (ref_logits, ref_grads) = results
    close(logits, ref_logits, factor)
    for name, ref in ref_grads.items():
        assert (grads[name] is None) == (ref is None), name
        if ref is not None:
            close(grads[name], ref, factor)
    return ref_grads


def cloned(cache: DynamicCache, config) -> DynamicCache:
    """A fresh DynamicCache holding copies of ``cache``'s keys and values (each run extends its own)."""
    copy = DynamicCache(config=config)
    for layer, entry in enumerate(cache.layers):
        copy.update(entry.keys.clone(), entry.values.clone(), layer)
    return copy


# ---- training ----------------------------------------------------------------------------------------------


TRAINING = [({}, False), ({}, True), ({"moda_ffn_kv": False}, True), ({"moda_depth_window": 1}, False),
            ({"moda_depth_window": 3, "moda_ffn_kv": False}, True), ({"num_key_value_heads": 1}, False),
            ({"num_key_value_heads": 4}, True), ({"norm_position": "post"}, True), ({"num_hidden_layers": 1}, False),
            ({"head_dim": 34, "num_key_value_heads": 1}, False)]


@pytest.mark.parametrize(("overrides", "padding"), TRAINING)
def test_training_equals_the_reference(monkeypatch, overrides, padding):
    model = tiny_model(seed=10, **overrides).to(F64).train()
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    grads = assert_matches_reference(model, {"input_ids": ids, "attention_mask": mask if padding else None},
                                     monkeypatch)
    if model.config.moda_ffn_kv and model.config.num_hidden_layers > 1:
        assert grads["model.layers.0.ffn_kv_proj.weight"].abs().max() > 0  # it reaches the loss only as an entry


def test_training_with_a_cached_prefix_equals_the_reference(monkeypatch):
    """T > 1 new tokens after a cached prefix (S > T: bottom-right causal mask), gradients on."""
    model = tiny_model(seed=12).to(F64).train()
    ids = torch.randint(3, 97, (2, 8))
    with torch.no_grad():
        prefix = output_cache(model(ids[:, :5], use_cache=True))
    assert_matches_reference(
        model, lambda: {"input_ids": ids[:, 5:], "cache": cloned(prefix, model.config), "use_cache": True},
        monkeypatch)


@pytest.mark.parametrize("trainable", ["all", "embeddings"])
def test_one_token_step_with_gradients_equals_the_reference(monkeypatch, trainable):
    model = tiny_model(seed=6).to(F64).train()
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        prefix = output_cache(model(ids[:, :6], use_cache=True))
    wrt, inputs = None, {"input_ids": ids[:, 6:]}
    if trainable == "embeddings":  # a frozen model: gradients w.r.t. the input embeddings only
        model.requires_grad_(False)
        embeds = model.model.embed_tokens(ids[:, 6:]).detach().requires_grad_(True)
        wrt, inputs = {"embeds": embeds}, {"inputs_embeds": embeds}
    assert_matches_reference(model, lambda: {**inputs, "cache": cloned(prefix, model.config), "use_cache": True},
                             monkeypatch, wrt=wrt)


def test_non_contiguous_inputs_embeds_gradients_equal_the_reference(monkeypatch):
    model = tiny_model(seed=13).to(F64).train().requires_grad_(False)
    embeds = torch.randn(6, 2, 48, dtype=F64).transpose(0, 1).requires_grad_(True)  # (B, T, D), not contiguous
    assert_matches_reference(model, {"inputs_embeds": embeds}, monkeypatch, wrt={"embeds": embeds})


def test_peft_lora_on_one_ffn_projection_equals_the_reference(monkeypatch):
    peft = pytest.importorskip("peft")
    model = tiny_model(seed=19).to(F64)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["layers.1.ffn_kv_proj"],
                                                      init_lora_weights=False))
    lora.train()
    trainable = {n: p for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("ffn_kv_proj" in n for n in trainable)
    grads = assert_matches_reference(lora, {"input_ids": torch.randint(3, 97, (2, 6))}, monkeypatch, wrt=trainable)
    assert all(g.abs().max() > 0 for g in grads.values())


def test_second_backward_reaching_only_the_first_layers_equals_the_reference(monkeypatch):
    """Two backwards through one retained graph, the second from layer 1's output only."""
    model = tiny_model(seed=20).to(F64).train()
    ids = torch.randint(3, 97, (2, 6))
    params = dict(model.named_parameters())
    probe = torch.randn(2, 6, 48, dtype=F64, generator=torch.Generator().manual_seed(3))
    results = []
    for backend in ("torch", "reference"):
        with on(backend, monkeypatch):
            out = model(ids, labels=ids, output_hidden_states=True)
            torch.autograd.grad(out.loss, list(params.values()), retain_graph=True, allow_unused=True)
            partial = (out.hidden_states[2] * probe).sum()  # the output of layer 1
            results.append(torch.autograd.grad(partial, list(params.values()), allow_unused=True))
    assert results[1][list(params).index("model.layers.0.ffn_kv_proj.weight")].abs().max() > 0
    for name, a, b in zip(params, *results):
        assert (a is None) == (b is None), name
        if b is not None:
            close(a, b, 256)


# ---- checkpointing -----------------------------------------------------------------------------------------


def checkpoint_from_outside(model, layers: list[int], reentrant: bool) -> None:
    """Wrap the forward of each of ``layers`` in ``torch.utils.checkpoint`` (the model is not told), as FSDP's
    ``apply_activation_checkpointing`` or a training framework does."""
    for i in layers:
        layer = model.model.layers[i]

        def wrapped(*args, _forward=layer.forward, **kwargs):
            return checkpoint(functools.partial(_forward, **kwargs), *args, use_reentrant=reentrant)

        layer.forward = wrapped


EVERY = [0, 1, 2, 3]
CHECKPOINTING = [("hf-reentrant", EVERY), ("hf-non-reentrant", EVERY), ("outside-reentrant", [1]),
                 ("outside-reentrant", EVERY), ("outside-non-reentrant", [1]), ("outside-non-reentrant", EVERY)]


@pytest.mark.parametrize(("how", "layers"), CHECKPOINTING,
                         ids=[f"{how}-{'every' if layers == EVERY else 'one'}" for how, layers in CHECKPOINTING])
def test_checkpointing_equals_the_reference(monkeypatch, how, layers):
    """The depth entries travel into and out of every layer as positional tensors, so every checkpoint tracks
    them (reentrant checkpointing from outside silently dropped the gradients through them, then raised)."""
    model = tiny_model(seed=14).to(F64).train()
    ids = torch.randint(3, 97, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with on("reference", monkeypatch):
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
    if how.startswith("hf"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": how == "hf-reentrant"})
    else:
        checkpoint_from_outside(model, layers, reentrant=how == "outside-reentrant")
    calls = []
    model.model.layers[layers[0]].self_attn.register_forward_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    with on("torch", monkeypatch):
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()  # a recomputed layer would
        # write the cache a second time: transformers' checkpointing turns it off, a wrapper from outside does not
    assert len(calls) == 2  # the layer ran, then was recomputed in the backward
    for name, g in want.items():
        close(model.get_parameter(name).grad, g, 256)
    assert want["model.layers.0.ffn_kv_proj.weight"].abs().max() > 0


# ---- second order --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", [False, True])
def test_second_order_gradients_equal_the_reference(monkeypatch, padding):
    """A gradient penalty (create_graph=True) through the whole model (the depth stream refused it before)."""
    model = tiny_model(seed=15).to(F64).train()
    ids = torch.randint(3, 97, (2, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    params = dict(model.named_parameters())
    results = []
    for backend in ("torch", "reference"):
        with on(backend, monkeypatch):
            loss = model(ids, attention_mask=mask if padding else None, labels=ids).loss
            grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
            penalty = sum((g * g).sum() for g in grads)
            results.append(torch.autograd.grad(penalty, list(params.values()), allow_unused=True))
    for name, a, b in zip(params, *results):
        assert b is not None and b.abs().max() > 0, name
        close(a, b, 256)


@pytest.mark.parametrize("reach", ["ffn_entry", "embeddings"])
def test_second_order_through_the_entries_equals_the_reference(monkeypatch, reach):
    model = tiny_model(seed=16).to(F64).train()
    ids = torch.randint(3, 97, (2, 5))
    if reach == "ffn_entry":
        target, inputs = model.model.layers[0].ffn_kv_proj.weight, {"input_ids": ids}
    else:
        model.requires_grad_(False)
        target = model.model.embed_tokens(ids).detach().requires_grad_(True)
        inputs = {"inputs_embeds": target}
    results = []
    for backend in ("torch", "reference"):
        with on(backend, monkeypatch):
            (grad,) = torch.autograd.grad(model(**inputs).logits.square().sum(), [target], create_graph=True)
            results.append(torch.autograd.grad(grad.square().sum(), [target])[0])
    assert results[1].abs().max() > 0
    close(*results, 256)


# ---- decoding ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"num_key_value_heads": 1}, {"moda_depth_window": 1}])
def test_cached_decode_steps_equal_the_reference_with_outputs(monkeypatch, overrides):
    """A one-token prompt, then a prefill and one-token steps with output_attentions and output_hidden_states."""
    model = tiny_model(seed=5, **overrides).to(F64)
    ids = torch.randint(3, 97, (2, 8))
    results = []
    for backend in ("torch", "reference"):
        with torch.no_grad(), on(backend, monkeypatch):
            outs = [model(ids[:, :1])]
            cache = DynamicCache(config=model.config)
            outs.append(model(ids[:, :5], cache=cache, use_cache=True))
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


def generate(model, ids, mask=None, **kwargs):
    config = GenerationConfig(max_new_tokens=5, pad_token_id=0, eos_token_id=None, **kwargs)
    torch.manual_seed(11)
    return model.generate(ids, attention_mask=mask, generation_config=config, output_scores=True,
                          return_dict_in_generate=True)


GENERATE = {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, top_k=20),
            "beam": dict(num_beams=3, do_sample=False), "static-cache": dict(cache_implementation="static")}


@pytest.mark.parametrize(("mode", "padding"), [("greedy", False), ("greedy", True), ("sample", True), ("beam", False),
                                               ("static-cache", True)])
def test_generate_equals_the_reference(monkeypatch, mode, padding):
    model = tiny_model(seed=8).to(F64)
    ids = torch.randint(3, 97, (2, 6))
    mask = None
    if padding:
        mask = torch.ones_like(ids)
        mask[-1, :3] = 0  # left padding of the last sequence
        ids = ids.masked_fill(mask == 0, 0)
    results = []
    for backend in ("torch", "reference"):
        with on(backend, monkeypatch):
            results.append(generate(model, ids, mask, **GENERATE[mode]))
    fast, ref = results
    assert torch.equal(fast.sequences, ref.sequences)
    for a, b in zip(fast.scores, ref.scores):
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite)
        close(a[finite], b[finite])


@pytest.mark.parametrize(("implementation", "prompt"), [("sdpa", 1), ("eager", 4)])
def test_static_cache_decoding_equals_the_reference(monkeypatch, prompt, implementation):
    """A StaticCache hands back all max_cache_len keys. For a prefill into the empty cache transformers leaves the
    sdpa mask out (SDPA's top-left causal alignment), which moda_attention reads bottom-right: the model writes it
    out. One-token prompts and decode steps get a mask (the unfilled keys)."""
    model = tiny_model(seed=9, attn_implementation=implementation).to(F64)
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad(), on("reference", monkeypatch):
        ref = model(ids).logits
    for backend in ("torch", "reference"):
        with torch.no_grad(), on(backend, monkeypatch):
            cache = StaticCache(config=model.config, max_cache_len=16)
            steps = [model(ids[:, :prompt], cache=cache, use_cache=True).logits]
            for t in range(prompt, 7):
                steps.append(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits)
        close(torch.cat(steps, dim=1), ref)


def test_model_cast_to_float64_between_calls(monkeypatch):
    model = tiny_model(seed=17)
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad(), on("torch", monkeypatch):
        model(ids)  # a float32 pass first
        model.to(F64)
        cache = output_cache(model(ids[:, :5], use_cache=True))
        step = model(ids[:, 5:], cache=cache, use_cache=True).logits
        full = model(ids).logits
    with torch.no_grad(), on("reference", monkeypatch):
        ref = model(ids).logits
    close(full, ref)
    close(step, ref[:, -1:])


# ---- autocast and inference mode -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_training_and_generate(monkeypatch, dtype):
    """Under CPU autocast (what Trainer(bf16=True) and TRL's trainers run) a training step and ``generate`` work on
    the fp32 model (they failed: "expected scalar type Float but found BFloat16", "v must share q's dtype"); the
    logits and gradients are as close to the float64 model's as the same autocast run on the reference backend."""
    model = tiny_model(seed=18).train()
    ids = torch.randint(3, 97, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    exact = model.to(F64)
    wrt = dict(exact.named_parameters())
    with on("reference", monkeypatch):
        want, want_grads = forward_backward(exact, {"input_ids": ids, "attention_mask": mask}, wrt)
    model.to(torch.float32)
    wrt = dict(model.named_parameters())
    runs = {}
    for backend in ("torch", "reference"):
        with on(backend, monkeypatch), torch.autocast("cpu", dtype=dtype):
            runs[backend] = forward_backward(model, {"input_ids": ids, "attention_mask": mask}, wrt)

    def error(a, b):
        return (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-30)

    eps = torch.finfo(dtype).eps
    (got, grads), (ref, ref_grads) = runs["torch"], runs["reference"]
    assert got.dtype == dtype and error(got, want) <= 2 * error(ref, want) + 4 * eps
    for name, exact_grad in want_grads.items():
        assert error(grads[name], exact_grad) <= 2 * error(ref_grads[name], exact_grad) + 4 * eps, name
    with on("torch", monkeypatch), torch.autocast("cpu", dtype=dtype):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 9)


def test_inference_mode_equals_no_grad(monkeypatch):
    model = tiny_model(seed=21)
    ids = torch.randint(3, 97, (2, 6))
    with on("torch", monkeypatch):
        with torch.no_grad():
            want = model(ids).logits
            want_gen = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            got = model(ids).logits
            got_gen = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want) and torch.equal(got_gen, want_gen)
