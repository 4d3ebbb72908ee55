"""MoDA model: depth-entry wiring, RoPE convention, masks, save/load, checkpointing, dtypes, validation."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import depthfusion_hf.models.modeling_moda as modeling_moda
from depthfusion_hf import MoDAConfig, MoDAForCausalLM, MoDAModel
from depthfusion_hf.models.transformers_compat import enable_activation_checkpointing, output_cache

from .helpers import TINY, tiny_config, tiny_llama_config, tiny_model


def spy_on_the_op(monkeypatch) -> list[dict]:
    """Record every call of the op from the model: the depth keys and values it reads (each [B, Hkv, T, d])."""
    calls = []
    real = modeling_moda.moda_attention

    def spy(q, k, v, depth_k, depth_v, **kwargs):
        calls.append({"keys": list(depth_k), "values": list(depth_v), **kwargs})
        return real(q, k, v, depth_k, depth_v, **kwargs)

    monkeypatch.setattr(modeling_moda, "moda_attention", spy)
    return calls


@pytest.mark.parametrize("norm_position", ["pre", "post"])
@pytest.mark.parametrize("ffn_kv", [True, False])
def test_layers_read_all_earlier_entries_of_their_token(monkeypatch, norm_position, ffn_kv):
    model = tiny_model(moda_ffn_kv=ffn_kv, norm_position=norm_position)
    calls = spy_on_the_op(monkeypatch)
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
    per_layer = 2 if ffn_kv else 1
    assert [len(c["keys"]) for c in calls] == [per_layer * layer for layer in range(4)]
    assert all(e.shape == (2, 2, 9, 12) for c in calls for e in c["keys"] + c["values"])
    assert len({c["backend"] for c in calls}) == 1  # resolved once per forward, passed to every call
    # Entry order [attn_0, (ffn_0), attn_1, ...]; attention entries are the post-RoPE keys the cache holds, and the
    # entries are the tensors the layers wrote (later layers read the very same objects: no copies).
    for layer in range(3):
        torch.testing.assert_close(calls[3]["keys"][per_layer * layer], cache.layers[layer].keys)
        assert calls[3]["keys"][per_layer * layer] is calls[layer + 1]["keys"][per_layer * layer]
    assert [layer.writes_ffn_kv for layer in model.model.layers] == [ffn_kv, ffn_kv, ffn_kv, False]
    assert not hasattr(model.model.layers[-1], "ffn_kv_proj")


@pytest.mark.parametrize("ffn_kv", [True, False])
@pytest.mark.parametrize("window", [1, 2])
def test_depth_window_reads_the_last_w_layers(monkeypatch, window, ffn_kv):
    model = tiny_model(moda_depth_window=window, moda_ffn_kv=ffn_kv)
    calls = spy_on_the_op(monkeypatch)
    with torch.no_grad():
        model(torch.randint(3, 97, (2, 6)))
    per_layer = 2 if ffn_kv else 1
    assert [len(c["keys"]) for c in calls] == [min(layer, window) * per_layer for layer in range(4)]
    if window == 2:  # layer 3 reads layers 1 and 2, layer 2 reads layers 0 and 1: the same layer-1 tensors
        assert all(a is b for a, b in zip(calls[3]["keys"][:per_layer], calls[2]["keys"][per_layer:]))


def test_depth_window_changes_the_model_and_full_window_is_none():
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        full = tiny_model()(ids).logits
        same = tiny_model(moda_depth_window=4)(ids).logits  # W >= L - 1 reads every earlier layer: same entries
        narrow = tiny_model(moda_depth_window=1)(ids).logits
    assert torch.equal(full, same)
    assert (full - narrow).abs().max() > 1e-3


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_ffn_entry_is_exactly_the_projected_mlp_input(monkeypatch, norm_position):
    """docs/MODA.md: the FFN-side entry is ffn_kv_proj(MLP input), its key rotated by its token's position."""
    model = tiny_model(norm_position=norm_position)
    layer = model.model.layers[1]
    mlp_inputs = []
    layer.mlp.register_forward_pre_hook(lambda module, args: mlp_inputs.append(args[0]))
    calls = spy_on_the_op(monkeypatch)
    with torch.no_grad():
        model(torch.randint(3, 97, (2, 5)))
        x = mlp_inputs[0]  # (B, T, D)
        kv = F.linear(x, layer.ffn_kv_proj.weight, layer.ffn_kv_proj.bias).view(2, 5, 2, 2, 12)  # (B, T, Hkv, 2, d)
        cos, sin = model.model.rotary_emb(x, torch.arange(5).unsqueeze(0))
        key, value = kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)  # (B, Hkv, T, d)
        half = key.shape[-1] // 2
        rotated = torch.cat([-key[..., half:], key[..., :half]], dim=-1)
        expected_key = key * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    got_key, got_value = calls[2]["keys"][3], calls[2]["values"][3]  # [attn_0, ffn_0, attn_1, ffn_1]
    scale = 64 * torch.finfo(torch.float32).eps * kv.abs().max().item()
    torch.testing.assert_close(got_value, value, rtol=0, atol=scale)
    torch.testing.assert_close(got_key, expected_key, rtol=0, atol=scale)


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


def test_output_attentions_of_a_decode_step_equal_the_full_forward():
    model = tiny_model(seed=3)
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        full = model(ids, output_attentions=True).attentions
        cache = output_cache(model(ids[:, :5], use_cache=True))
        step = model(ids[:, 5:], cache=cache, use_cache=True, output_attentions=True).attentions
    for layer, (a, b) in enumerate(zip(full, step)):
        assert b.shape == (2, 4, 1, 6 + 2 * layer)  # [B, Hq, 1, S + M_l]
        torch.testing.assert_close(b, a[:, :, -1:], rtol=1e-5, atol=1e-6)


def test_attentions_carry_gradients():
    """``output_attentions`` in training: the weights are part of the graph, as Llama's (``retain_grad`` works and
    a loss on them reaches the parameters), not computed under ``no_grad``."""
    model = tiny_model(seed=4).train()
    out = model(torch.randint(3, 97, (2, 6)), output_attentions=True)
    weights = out.attentions[2]
    weights.retain_grad()
    weights[..., 6:].sum().backward()  # the mass on layer 2's depth entries
    assert weights.grad is not None
    assert model.model.layers[0].ffn_kv_proj.weight.grad.abs().max() > 0


def test_an_entry_changed_in_place_before_the_backward_raises():
    """The op keeps the entries by reference; autograd's own saved-tensor check refuses a stale one."""
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    entry = torch.randn(1, 2, 4, 8, requires_grad=True) * 1.0
    out = modeling_moda.moda_attention(q, k, v, [entry], [entry * 2.0])
    entry.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_single_layer_moda_is_llama():
    llama = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1)).eval()
    moda = MoDAForCausalLM(tiny_config(num_hidden_layers=1)).eval()
    moda.load_state_dict(llama.state_dict())
    ids = torch.randint(3, 97, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(moda(ids).logits, llama(ids).logits, rtol=1e-5, atol=1e-5)
        two_layer = MoDAForCausalLM(tiny_config(num_hidden_layers=2)).eval()
        llama2 = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=2)).eval()
        two_layer.load_state_dict(llama2.state_dict(), strict=False)
        assert (two_layer(ids).logits - llama2(ids).logits).abs().max() > 1e-3  # depth entries change layer 2


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_depth_logits_are_position_free(norm_position):
    # RoPE convention: every depth key is rotated by its own token's position, like the query, so a global
    # shift of the positions changes nothing (an unrotated FFN key would break this).
    model = tiny_model(norm_position=norm_position)
    ids = torch.randint(3, 97, (2, 8))
    positions = torch.arange(8).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        a = model(ids, position_ids=positions).logits
        b = model(ids, position_ids=positions + 37).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_no_leak_from_future_tokens():
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 10))
    changed = ids.clone()
    changed[:, 6:] = torch.randint(3, 97, (1, 4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[:, :6], model(changed).logits[:, :6])


def test_eager_and_sdpa_agree_with_padding():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    outs = {}
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = (model(ids, attention_mask=mask).logits, model(ids).logits)
    keep = mask.bool()
    torch.testing.assert_close(outs["eager"][0][keep], outs["sdpa"][0][keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["eager"][1], outs["sdpa"][1], rtol=1e-5, atol=1e-5)
    # Left padding does not change the real tokens of the padded row (positions follow the mask).
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=positions).logits[0, 3:]
        alone = model(ids[:1, 3:]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_unsupported_attention_implementation_raises():
    model = tiny_model()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="MoDA supports attn_implementation"):
        model(torch.randint(3, 97, (1, 4)))


def test_vllm_attention_is_refused_at_construction_with_the_reason(monkeypatch):
    """vLLM's Transformers backend registers its attention function as ``"vllm"``, sets ``_attn_implementation =
    "vllm"`` on the config, then builds the model (served for real in tests/serving/)."""
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "vllm", ALL_ATTENTION_FUNCTIONS["sdpa"])
    config = tiny_config()
    config._attn_implementation = "vllm"
    with pytest.raises(ValueError, match=r"cannot be served by vLLM.*log-sum-exp.*model\.generate"):
        MoDAForCausalLM(config)


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_save_load_identical_logits(tmp_path, norm_position):
    model = tiny_model(norm_position=norm_position)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MoDAForCausalLM) and loaded.config.norm_position == norm_position
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_gradient_checkpointing_same_grads():
    model = tiny_model().train()
    ids = torch.randint(3, 97, (2, 8))
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            enable_activation_checkpointing(model)
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert model.model.layers[0].gradient_checkpointing
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert grads[0]["model.layers.0.ffn_kv_proj.weight"].abs().max() > 0


def test_bf16_forward_and_backward():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 8))
    with torch.no_grad():
        reference = model(ids).logits
    model = model.to(torch.bfloat16).train()
    out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()
    out.loss.backward()
    assert torch.isfinite(model.model.layers[0].ffn_kv_proj.weight.grad).all()
    assert (out.logits.float() - reference).abs().max() < 0.1 * reference.abs().max()


def test_output_attentions_and_depth_share():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
    assert [a.shape for a in out.attentions] == [(2, 4, 6, 6 + 2 * layer) for layer in range(4)]
    keep = mask.bool()
    for weights in out.attentions:
        totals = weights.sum(-1).transpose(1, 2)  # (B, T, Hq)
        torch.testing.assert_close(totals[keep], torch.ones(int(keep.sum()), 4))
    # A padded token has no visible sequence key; at layer 0 it has no depth entry either: all zeros.
    assert out.attentions[0][1, :, :2].abs().max() == 0
    share = model.depth_attention_share(ids, attention_mask=mask)
    assert share.shape == (4,) and share[0] == 0 and (share[1:] > 0).all() and (share <= 1).all()
    manual = torch.stack([
        (a[..., 6:].sum(-1) * mask[:, None]).sum((0, 2)).div(mask.sum()).mean() for a in out.attentions
    ])
    torch.testing.assert_close(share, manual)
    assert model.depth_attention_share(ids, per_head=True).shape == (4, 4)


def test_built_on_the_llama_classes():
    """transformers' modular style: the causal LM is a LlamaForCausalLM (its forward, accessors and plans)."""
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    assert issubclass(MoDAForCausalLM, LlamaForCausalLM)
    assert issubclass(modeling_moda.MoDAPreTrainedModel, LlamaPreTrainedModel)
    assert MoDAForCausalLM.forward is LlamaForCausalLM.forward
    assert MoDAForCausalLM._tied_weights_keys == LlamaForCausalLM._tied_weights_keys
    assert isinstance(tiny_model().model, MoDAModel)


def test_auto_classes_and_tied_embeddings():
    config = tiny_config(tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    assert isinstance(model, MoDAForCausalLM)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert isinstance(model.get_decoder() if hasattr(model, "get_decoder") else model.model, MoDAModel)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(norm_position="sandwich"), "norm_position"),
        (dict(norm_position=None), "norm_position"),
        (dict(moda_ffn_kv="yes"), "moda_ffn_kv"),
        (dict(attention_dropout=0.1), "attention_dropout"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(num_key_value_heads=8), "num_key_value_heads"),
        (dict(hidden_size=50), "hidden_size"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
        (dict(head_dim=7), "head_dim"),
        (dict(moda_depth_window=0), "moda_depth_window"),
        (dict(moda_depth_window=5), "moda_depth_window"),
        (dict(moda_depth_window=2.0), "moda_depth_window"),
        (dict(moda_depth_window=True), "moda_depth_window"),
    ],
)
def test_invalid_config_raises(overrides, field):
    with pytest.raises(ValueError, match=field):
        MoDAConfig(**{**TINY, **overrides})
