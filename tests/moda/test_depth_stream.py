"""The whole-pass depth stream: same function as the tuple-and-stack path, autograd ordering, windows, fast paths."""

import gc
import importlib
import weakref

import pytest
import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

import depthfusion_hf.models.moda.modeling_moda as modeling_moda
from depthfusion_hf import MoDAForCausalLM, MoDAModel
from depthfusion_hf.models.moda.depth_stream import DepthStream

from .helpers import tiny_config, tiny_model

# The package exports the op under the submodule's name, so the module is looked up explicitly.
moda_attention_module = importlib.import_module("depthfusion_hf.models.moda.moda_attention")
depth_stream_module = importlib.import_module("depthfusion_hf.models.moda.depth_stream")


def run(model, ids, mask=None, stream=True):
    """Logits and parameter gradients of one forward + backward, on the stream or the tuple path."""
    model.zero_grad(set_to_none=True)
    if not stream:
        model.model.uses_depth_stream = lambda *args: False
    try:
        out = model(ids, attention_mask=mask, labels=ids)
        out.loss.backward()
    finally:
        model.model.__dict__.pop("uses_depth_stream", None)
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, dtype):
    """Equal up to the rounding of a different summation order: 64 eps of the largest magnitude involved."""
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(a, b, rtol=0, atol=64 * eps * max(a.abs().max().item(), b.abs().max().item(), 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"moda_ffn_kv": False}, {"norm_position": "post"}, {"moda_depth_window": 2}, {"num_key_value_heads": 4},
     {"head_dim": 64, "num_hidden_layers": 5}],  # d = 64: the depth products of layers 2.. are large enough for bmm
)
def test_stream_equals_tuple_path(overrides, dtype):
    model = tiny_model(**overrides).to(dtype).train()
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: rows with no visible sequence key in layer 0
    logits, grads = run(model, ids, mask, stream=True)
    ref_logits, ref_grads = run(model, ids, mask, stream=False)
    assert_same(logits, ref_logits, dtype)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert_same(grads[name], grad, dtype)
    assert ref_grads["model.layers.0.self_attn.k_proj.weight"].abs().max() > 0


def test_stream_is_used_and_every_writer_runs_after_its_readers(monkeypatch):
    model = tiny_model().train()
    order = []
    real_gradient = DepthStream.entry_gradient
    real_backward = DepthStream.fast_backward

    def entry_gradient(self, slot):
        order.append(("write", slot))
        return real_gradient(self, slot)

    def fast_backward(self, saved, grad_out, needs, reader, start, stop):
        order.append(("read", start, stop))
        return real_backward(self, saved, grad_out, needs, reader, start, stop)

    monkeypatch.setattr(DepthStream, "entry_gradient", entry_gradient)
    monkeypatch.setattr(DepthStream, "fast_backward", fast_backward)
    ids = torch.randint(3, 97, (2, 6))
    model(ids, labels=ids).loss.backward()
    writes = [event[1] for event in order if event[0] == "write"]
    assert sorted(writes) == list(range(6))  # 3 layers x (attention, FFN) entries, each gradient formed once
    for position, event in enumerate(order):
        if event[0] == "write":
            later_reads = [e for e in order[position:] if e[0] == "read" and e[1] <= event[1] < e[2]]
            assert not later_reads, f"slot {event[1]} formed before a reader's backward: {order}"


def test_partially_frozen_model_matches_tuple_path():
    model = tiny_model().train()
    for name, param in model.named_parameters():
        if name.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1.self_attn")):
            param.requires_grad_(False)
    ids = torch.randint(3, 97, (2, 7))
    logits, grads = run(model, ids)
    ref_logits, ref_grads = run(model, ids, stream=False)
    assert_same(logits, ref_logits, torch.float32)
    assert grads.keys() == ref_grads.keys() and "model.layers.1.ffn_kv_proj.weight" in grads
    for name, grad in ref_grads.items():
        assert_same(grads[name], grad, torch.float32)


def test_retained_graph_backward_twice_gives_the_same_gradients():
    model = tiny_model().train()
    ids = torch.randint(3, 97, (2, 7))
    loss = model(ids, labels=ids).loss
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, first[name], rtol=0, atol=0, msg=name)  # the same arithmetic twice


def test_stream_is_freed_without_the_garbage_collector(monkeypatch):
    model = tiny_model().train()
    streams = []
    real = MoDAModel.depth_stream

    def capture(self, hidden_states, attention_mask):
        stream = real(self, hidden_states, attention_mask)
        streams.append(weakref.ref(stream))
        return stream

    monkeypatch.setattr(MoDAModel, "depth_stream", capture)
    ids = torch.randint(3, 97, (2, 7))
    gc.collect()
    gc.disable()
    try:
        loss = model(ids, labels=ids).loss
        assert streams[0]() is not None  # the graph holds it until the backward
        loss.backward()
        del loss
        assert streams[0]() is None, "a reference cycle keeps the depth stream (and its buffers) alive"
    finally:
        gc.enable()


def test_gradient_checkpointing_uses_the_tuple_path():
    model = tiny_model().train()
    ids = torch.randint(3, 97, (2, 7))
    probe = torch.zeros(2, 1, 7, 48)
    assert model.model.uses_depth_stream(probe, None, "torch")
    model.activation_checkpointing_enable()
    assert not model.model.uses_depth_stream(probe, None, "torch")
    with torch.no_grad():  # no backward to replay: the stream again
        assert model.model.uses_depth_stream(probe, None, "torch")
    model(ids, labels=ids).loss.backward()


@pytest.mark.parametrize("ffn_kv", [True, False])
@pytest.mark.parametrize("window", [1, 2])
def test_depth_window_reads_the_last_w_layers(monkeypatch, window, ffn_kv):
    model = tiny_model(moda_depth_window=window, moda_ffn_kv=ffn_kv)
    seen = []
    real = DepthStream.attend

    def spy(self, q, k, v, attention_mask, scale, start, stop):
        seen.append((start, stop))
        return real(self, q, k, v, attention_mask, scale, start, stop)

    monkeypatch.setattr(DepthStream, "attend", spy)
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        model(ids)
    per_layer = 2 if ffn_kv else 1
    assert seen == [(max(0, layer - window) * per_layer, layer * per_layer) for layer in range(4)]


def test_depth_window_changes_the_model_and_full_window_is_none():
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        full = tiny_model()(ids).logits
        same = tiny_model(moda_depth_window=4)(ids).logits  # W >= L - 1 reads every earlier layer: same slots
        narrow = tiny_model(moda_depth_window=1)(ids).logits
    assert torch.equal(full, same)
    assert (full - narrow).abs().max() > 1e-3


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_ffn_entry_is_exactly_the_projected_mlp_input(monkeypatch, norm_position):
    """docs/MODA.md: the FFN-side entry is ffn_kv_proj(MLP input), key rotated by its token's position."""
    model = tiny_model(norm_position=norm_position)
    layer = model.model.layers[1]
    mlp_inputs, written = [], {}
    layer.mlp.register_forward_pre_hook(lambda module, args: mlp_inputs.append(args[0]))
    real = DepthStream.write

    def spy(self, slot, key, value):
        written[slot] = (key.clone(), value.clone())
        return real(self, slot, key, value)

    monkeypatch.setattr(DepthStream, "write", spy)
    ids = torch.randint(3, 97, (2, 5))
    with torch.no_grad():
        model(ids)
        x = mlp_inputs[0]  # (B, T, D)
        kv = F.linear(x, layer.ffn_kv_proj.weight, layer.ffn_kv_proj.bias).view(2, 5, 2, 2, 12)  # (B, T, Hkv, 2, d)
        cos, sin = model.model.rotary_emb(x, torch.arange(5).unsqueeze(0))
        key, value = kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)  # (B, Hkv, T, d)
        half = key.shape[-1] // 2
        rotated = torch.cat([-key[..., half:], key[..., :half]], dim=-1)
        expected_key = key * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    got_key, got_value = written[layer.depth_slot + 1]
    scale = 64 * torch.finfo(torch.float32).eps * kv.abs().max().item()
    torch.testing.assert_close(got_value, value, rtol=0, atol=scale)
    torch.testing.assert_close(got_key, expected_key, rtol=0, atol=scale)


def test_cached_decode_resolves_the_backend_once_and_skips_validation(monkeypatch):
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    calls = []
    real_resolve = modeling_moda.resolve_backend
    monkeypatch.setattr(modeling_moda, "resolve_backend", lambda *a: calls.append(a) or real_resolve(*a))

    def no_validation(*args, **kwargs):
        raise AssertionError("the public op's validation ran in the layer loop")

    monkeypatch.setattr(moda_attention_module, "check_moda_inputs", no_validation)
    with torch.no_grad():
        step = model(torch.randint(3, 97, (1, 1)), cache=cache, use_cache=True).logits
    assert len(calls) == 1 and step.shape == (1, 1, 97)


def test_mutated_config_is_rejected_at_model_construction():
    config = tiny_config()
    config.moda_depth_window = 0
    with pytest.raises(ValueError, match="moda_depth_window"):
        MoDAForCausalLM(config)
    config = tiny_config()
    config.norm_position = "sandwich"
    with pytest.raises(ValueError, match="norm_position"):
        MoDAForCausalLM(config)


@pytest.mark.parametrize(
    "ids,message",
    [
        (torch.zeros(1, 0, dtype=torch.long), r"at least one token; got shape \(1, 0\)"),
        (torch.tensor([[3, 97]]), r"\[0, vocab_size=97\); got min 3, max 97"),
        (torch.tensor([[-1, 5]]), r"got min -1, max 5"),
        (torch.tensor([[1.0, 2.0]]), "integer tensor"),
    ],
)
def test_bad_token_inputs_raise(ids, message):
    with pytest.raises(ValueError, match=message):
        tiny_model()(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_key_value_heads": 4}, {"num_key_value_heads": 1}, {"moda_ffn_kv": False}, {"moda_depth_window": 2}],
)
def test_decode_step_equals_the_general_path(monkeypatch, overrides, dtype):
    model = tiny_model(seed=2, **overrides).to(dtype)
    ids = torch.randint(3, 97, (2, 6))
    calls = []
    real = DepthStream.decode_step

    def counted(self, *args):
        calls.append(args)
        assert self.keys is None  # one-token decoding keeps the entries as they are: no buffer, no copies
        return real(self, *args)

    monkeypatch.setattr(DepthStream, "decode_step", counted)
    with torch.no_grad():
        cache = model(ids[:, :5], use_cache=True).cache
        fast = model(ids[:, 5:], cache=cache, use_cache=True).logits
        assert len(calls) == 4  # every layer of the one-token step, none in the prefill
        monkeypatch.setattr(DepthStream, "decode_step", lambda self, q, k, v, scale, start, stop: self.fast_forward(
            q, k, v, None, scale, start, stop)[0])
        cache.crop(-1)
        general = model(ids[:, 5:], cache=cache, use_cache=True).logits
    assert_same(fast, general, dtype)


def test_output_attentions_of_a_decode_step_equal_the_full_forward():
    model = tiny_model(seed=3)
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        full = model(ids, output_attentions=True).attentions
        cache = model(ids[:, :5], use_cache=True).cache
        step = model(ids[:, 5:], cache=cache, use_cache=True, output_attentions=True).attentions
    for layer, (a, b) in enumerate(zip(full, step)):
        assert b.shape == (2, 4, 1, 6 + 2 * layer)  # [B, Hq, 1, S + M_l]
        assert_same(b, a[:, :, -1:], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_depth_key_rotation_is_llamas_bit_for_bit(dtype):
    key = torch.randn(2, 5, 3, 12, dtype=torch.float64).to(dtype).transpose(1, 2)  # (B, Hkv, T, d), strided
    cos, sin = LlamaRotaryEmbedding(tiny_config())(key, torch.arange(5).unsqueeze(0) + 7)  # (1, T, d = 12)
    expected = key * cos.unsqueeze(1) + rotate_half(key) * sin.unsqueeze(1)  # Llama's apply_rotary_pos_emb
    assert torch.equal(modeling_moda.rotate_depth_key(key, modeling_moda.depth_rotary(cos, sin)), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("group,entries,head_dim", [(1, 3, 12), (2, 2, 64), (1, 7, 64), (2, 11, 64)])
def test_depth_products_match_einsum(group, entries, head_dim, dtype):
    """_depth_dots and _depth_mix read M separate entries [N, d] (contiguous or with strided rows, as an FFN value
    is) one fused product at a time; the small per-token tensors are entry-major [M, N, G]."""
    tokens = 37
    packed = torch.randn(tokens, 2, entries, head_dim, dtype=dtype)  # rows of stride 2 M d, like [.., 2, d] views
    slots = [packed[:, 1, m] if m % 2 else packed[:, 0, m].contiguous() for m in range(entries)]
    stacked = torch.stack(slots)  # (M, N, d)
    x = torch.randn(tokens, group, head_dim, dtype=dtype)
    weights = torch.randn(entries, tokens, group, dtype=dtype)
    start = torch.randn(tokens, group, head_dim, dtype=dtype)
    eps = torch.finfo(dtype).eps
    out = torch.full((entries, tokens, group), float("nan"), dtype=dtype)
    dots = depth_stream_module._depth_dots(x, slots, out)
    assert dots is out
    expected = torch.einsum("ngd,mnd->mng", x, stacked)
    torch.testing.assert_close(dots, expected, rtol=0, atol=16 * eps * head_dim * x.abs().max() * stacked.abs().max())
    mixed = depth_stream_module._depth_mix(weights, slots, start.clone())
    expected = start + torch.einsum("mng,mnd->ngd", weights, stacked)
    scale = max(1.0, (weights.abs().max() * stacked.abs().max()).item(), start.abs().max().item())
    bound = 16 * eps * (entries + 1) * scale
    torch.testing.assert_close(mixed, expected, rtol=0, atol=bound)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_entry_modified_in_place_before_the_backward_is_rejected(layout):
    """The fast path keeps the entries as written (no copy): one changed in place after it was written would give its
    readers' backward stale values, so the backward raises, as autograd does for its own saved tensors."""
    batch, heads, tokens, head_dim = 2, 2, 3, 4

    def make(requires_grad=True):
        x = torch.randn(batch, tokens, heads, head_dim, dtype=torch.float64).transpose(1, 2)  # (B, H, T, d)
        return x.requires_grad_(requires_grad)

    def run_once(modify):
        stream = DepthStream(capacity=1, num_readers=2, backend="torch", track_grad=True)
        q0, k0, v0, q1, k1, v1 = (make() for _ in range(6))
        out0 = stream.attend(q0, k0, v0, None, 0.5, 0, 0)
        key = k0 * 2.0
        if layout == "head_major":
            key = key.contiguous()  # rows are then read through a copy, made when first read
        value = v0 * 2.0
        stream.write(0, key, value)
        out1 = stream.attend(q1, k1, v1, None, 0.5, 0, 1)
        stream.close()
        if modify:
            with torch.no_grad():
                key.add_(1.0)
        (out0.sum() + out1.square().sum()).backward()
        return k0.grad

    assert run_once(modify=False).abs().max() > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation: MoDA depth entry 0"):
        run_once(modify=True)
