"""AttnRes model: full and block AttnRes against the paper's loop, zero-query init, HF behaviour."""

import functools

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from depthfusion_hf.models.configuration_attnres import AttnResConfig
from depthfusion_hf.models.depthfusion_common import check_token_inputs
from depthfusion_hf.models.modeling_attnres import AttnResForCausalLM, AttnResModel
from depthfusion_hf.models.transformers_compat import enable_activation_checkpointing
from tests.causal_lm_checks import assert_a_few_adamw_steps_lower_the_loss

from .helpers import naive_attnres_forward, randomise_attnres, tiny_config, tiny_llama_config

LAYERS = tiny_config().num_hidden_layers
HIDDEN = tiny_config().hidden_size


@pytest.mark.parametrize("block_size", [None, 1, 2, 3, 5, 8])
def test_matches_naive_loop(block_size):
    """Full AttnRes; blocks dividing the 8 sub-layers (1, 2), not dividing them (3, 5: short last block), one block."""
    model = AttnResForCausalLM(tiny_config(attnres_block_size=block_size, attn_implementation="sdpa")).eval()
    randomise_attnres(model)
    ids = torch.randint(3, 97, (2, 11))
    with torch.no_grad():
        logits, naive_alphas = naive_attnres_forward(model, ids)
        out = model.model(ids, output_depth_weights=True)
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)
    assert len(out.depth_weights) == len(naive_alphas) == 2 * LAYERS
    for got, want in zip(out.depth_weights, naive_alphas):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # the weights really are content-dependent (not one softmax for every token)
    assert (out.depth_weights[-1] - out.depth_weights[-1][:1, :1]).abs().max() > 1e-3


@pytest.mark.parametrize("block_size,sources", [(None, 9), (1, 9), (2, 5), (3, 4), (8, 2)])
def test_number_of_sources(block_size, sources):
    """The final call reads N + 1 tensors: the embedding and N blocks (2L blocks of one for full AttnRes)."""
    config = tiny_config(attnres_block_size=block_size)
    assert config.num_blocks + 1 == sources
    model = AttnResForCausalLM(config).eval()
    weights = model.depth_attention_weights(torch.randint(3, 97, (1, 5)))
    assert weights.shape == (2 * LAYERS + 1, sources)


def test_full_equals_block_size_one():
    ids = torch.randint(3, 97, (2, 9))
    torch.manual_seed(0)
    full = AttnResForCausalLM(tiny_config()).eval()
    randomise_attnres(full)
    one = AttnResForCausalLM(tiny_config(attnres_block_size=1)).eval()
    one.load_state_dict(full.state_dict())
    with torch.no_grad():
        assert torch.equal(full(ids).logits, one(ids).logits)


def test_added_parameters_are_two_vectors_per_call():
    llama = sum(p.numel() for p in LlamaForCausalLM(tiny_llama_config()).parameters())
    ours = AttnResForCausalLM(tiny_config(attnres_block_size=2))
    assert sum(p.numel() for p in ours.parameters()) - llama == 2 * (2 * LAYERS) * HIDDEN
    new = sorted(n for n, _ in ours.named_parameters() if "_res." in n)
    assert new[:4] == ["model.layers.0.mlp_res.key_norm_weight", "model.layers.0.mlp_res.query",
                       "model.layers.0.output_res.key_norm_weight", "model.layers.0.output_res.query"]


def _at_init(model) -> bool:
    mixes = [m for layer in model.model.layers for m in (layer.mlp_res, layer.output_res)]
    return all(torch.equal(m.query.detach(), torch.zeros(HIDDEN)) and
               torch.equal(m.key_norm_weight.detach(), torch.ones(HIDDEN)) for m in mixes)


def test_init_is_uniform_averaging():
    model = AttnResForCausalLM(tiny_config(attnres_block_size=3)).eval()
    assert _at_init(model)
    weights = model.depth_attention_weights(torch.randint(3, 97, (2, 6)))
    for row, n in zip(weights, [1, 2, 2, 2, 3, 3, 3, 4, 4]):  # S = 3: blocks {1,2,3} {4,5,6} {7,8}
        torch.testing.assert_close(row[:n], torch.full((n,), 1.0 / n), rtol=1e-6, atol=1e-7)
        assert row[n:].abs().sum() == 0


def test_init_survives_post_init_and_reinit():
    model = AttnResForCausalLM(tiny_config())
    randomise_attnres(model)
    model._init_weights(model.model.layers[1].mlp_res)  # what a user's re-initialisation calls
    assert torch.equal(model.model.layers[1].mlp_res.query.detach(), torch.zeros(HIDDEN))
    for module in model.modules():  # a full re-initialisation, as after to_empty()
        module._is_hf_initialized = False
    model.init_weights()
    assert _at_init(model)


def test_checkpoint_without_attnres_weights_loads_the_init(tmp_path):
    model = AttnResForCausalLM(tiny_config(attnres_block_size=2))
    randomise_attnres(model)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights = {k: v for k, v in weights.items() if "_res." not in k}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = AttnResForCausalLM.from_pretrained(tmp_path)
    assert _at_init(loaded)
    torch.testing.assert_close(loaded.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def test_save_load_identical_logits(tmp_path):
    model = AttnResForCausalLM(tiny_config(attnres_block_size=3)).eval()
    randomise_attnres(model)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AttnResForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.attnres_block_size == 3
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        # memory-mapped (possibly misaligned) weights may take other CPU kernel paths: rounding only
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


def test_hidden_states_are_layer_outputs():
    model = AttnResModel(tiny_config(attnres_block_size=2)).eval()
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        embeds = model.embed_tokens(ids)
    assert len(out.hidden_states) == LAYERS + 1
    assert torch.equal(out.hidden_states[0], embeds)  # sub-layer 1 reads the embedding alone
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
    assert out.depth_weights is None


def test_eager_and_sdpa_agree_with_padding():
    ids = torch.randint(3, 97, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    outs = []
    for impl in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = AttnResForCausalLM(tiny_config(attnres_block_size=3, attn_implementation=impl)).eval()
        randomise_attnres(model)
        with torch.no_grad():
            outs.append(model(ids, attention_mask=mask).logits)
    torch.testing.assert_close(outs[0][0, 3:], outs[1][0, 3:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_same_gradients(reentrant):
    model = AttnResForCausalLM(tiny_config(attnres_block_size=3))
    randomise_attnres(model)
    ids = torch.randint(3, 97, (2, 8))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.train()
    plain = grads()
    enable_activation_checkpointing(model, {"use_reentrant": reentrant})
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = grads()
    names = {n for n, _ in model.named_parameters()}
    assert plain.keys() == checkpointed.keys() == names  # every parameter, the queries and embeddings included
    for name in plain:
        torch.testing.assert_close(plain[name], checkpointed[name], rtol=1e-5, atol=1e-6)


def test_bf16_forward_backward():
    model = AttnResForCausalLM(tiny_config(attnres_block_size=2)).to(torch.bfloat16)
    ids = torch.randint(3, 97, (2, 8))
    out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    out.loss.backward()
    query = model.model.layers[0].output_res.query
    assert query.grad is not None and query.grad.dtype == torch.bfloat16 and torch.isfinite(query.grad).all()
    assert query.grad.abs().max() > 0


def test_bf16_close_to_fp32():
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config()).eval()
    randomise_attnres(model)
    ids = torch.randint(3, 97, (2, 8))
    with torch.no_grad():
        fp32 = model(ids).logits
        bf16 = model.to(torch.bfloat16)(ids).logits.float()
    # bf16 weights and activations (8-bit mantissa, eps 2^-8) through 8 sub-layers and the head: the relative
    # error of the logits is a few units of 2^-8 (3 to 11 over 12 seeds of this shape; a softmax or mix done
    # in bf16 inside the op, or a wrong dtype path, would not stay there)
    assert (bf16 - fp32).norm() <= 16 * 2**-8 * fp32.norm()


def test_loss_trains_the_pseudo_queries():
    model = AttnResForCausalLM(tiny_config(attnres_block_size=2))
    assert_a_few_adamw_steps_lower_the_loss(model)
    assert not _at_init(model)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("attnres_block_size", 0, r"`attnres_block_size` must be an integer in \[1, 8\]"),
        ("attnres_block_size", 9, r"`attnres_block_size` must be an integer in \[1, 8\]"),
        ("attnres_block_size", 2.5, r"`attnres_block_size`"),
        ("attnres_block_size", True, r"`attnres_block_size`"),
        ("num_hidden_layers", 0, r"`num_hidden_layers` must be an integer >= 1"),
        ("hidden_size", 50, r"`hidden_size` \(50\) must be divisible by `num_attention_heads` \(4\)"),
        ("num_key_value_heads", 3, r"multiple of `num_key_value_heads` \(3\)"),
    ],
)
def test_invalid_config(field, value, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**{field: value})


def test_block_size_bound_follows_the_depth():
    assert tiny_config(num_hidden_layers=2, attnres_block_size=4).num_blocks == 1
    with pytest.raises(ValueError, match=r"`attnres_block_size` must be an integer in \[1, 4\]"):
        tiny_config(num_hidden_layers=2, attnres_block_size=5)


@pytest.mark.parametrize("model_class", [AttnResModel, AttnResForCausalLM])
def test_config_changed_after_construction_is_rejected_by_the_model(model_class):
    config = tiny_config()
    config.attnres_block_size = 0
    with pytest.raises(ValueError, match=r"`attnres_block_size` must be an integer in \[1, 8\]"):
        config.check_fields()
    with pytest.raises(ValueError, match=r"`attnres_block_size` must be an integer in \[1, 8\]"):
        model_class(config)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, r"input_ids must have at least one token; got shape"),
        ({"input_ids": torch.tensor([[3, -1, 7]])}, r"input_ids must lie in \[0, vocab_size=97\); got min -1, max 7"),
        ({"input_ids": torch.tensor([[3, 97]])}, r"got min 3, max 97"),
        ({"inputs_embeds": torch.zeros(1, 0, HIDDEN)}, r"inputs_embeds must have at least one token"),
        ({}, "exactly one of input_ids or inputs_embeds"),
    ],
)
def test_bad_token_inputs_name_the_problem(kwargs, match):
    model = AttnResForCausalLM(tiny_config()).eval()
    with pytest.raises(ValueError, match=match):
        check_token_inputs(kwargs.get("input_ids"), kwargs.get("inputs_embeds"), 97)
    with pytest.raises(ValueError, match=match), torch.no_grad():
        model(**kwargs)


def test_inputs_embeds_equal_input_ids():
    model = AttnResForCausalLM(tiny_config(attnres_block_size=2)).eval()
    randomise_attnres(model)
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        assert torch.equal(model(inputs_embeds=model.model.embed_tokens(ids)).logits, model(ids).logits)


def test_depth_attention_weights_average_real_tokens_only():
    model = AttnResForCausalLM(tiny_config(attnres_block_size=2)).eval()
    randomise_attnres(model, seed=3)
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    per_token = model.depth_attention_weights(ids, attention_mask=mask, per_token=True)
    assert per_token.shape == (2, 7, 2 * LAYERS + 1, 5)
    torch.testing.assert_close(per_token.sum(-1), torch.ones(2, 7, 2 * LAYERS + 1), rtol=1e-5, atol=1e-6)
    assert torch.equal(per_token[..., 0, :], torch.tensor([1.0, 0, 0, 0, 0]).expand(2, 7, 5))
    mean = model.depth_attention_weights(ids, attention_mask=mask)
    want = (per_token[0, 3:].sum(0) + per_token[1].sum(0)) / 11
    torch.testing.assert_close(mean, want, rtol=1e-6, atol=1e-7)
    # the padded tokens do change the plain average, so leaving them out is a real difference
    assert (per_token.mean((0, 1)) - mean).abs().max() > 1e-4
    with pytest.raises(ValueError, match="attention_mask must have the shape of input_ids"):
        model.depth_attention_weights(ids, attention_mask=mask[:, 1:])


def test_config_round_trips_through_json(tmp_path):
    config = tiny_config(attnres_block_size=5)
    config.save_pretrained(tmp_path)
    loaded = AttnResConfig.from_pretrained(tmp_path)
    assert loaded.attnres_block_size == 5 and loaded.model_type == "attnres"
    assert AttnResConfig.from_pretrained(tmp_path, attnres_block_size=None).attnres_block_size is None


def test_device_map_auto_and_disk_offload_give_the_same_logits(tmp_path):
    """accelerate's hooks wrap each decoder layer, whose depth-state inputs are positional: they must pass through."""
    from transformers import AutoModelForCausalLM

    model = AttnResForCausalLM(tiny_config(attnres_block_size=3)).eval()
    randomise_attnres(model)
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        expected = AttnResForCausalLM.from_pretrained(tmp_path / "model").eval()(ids).logits
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map="auto",
                                                     max_memory={"cpu": size // 2},
                                                     offload_folder=str(tmp_path / "offload")).eval()
    assert "disk" in set(offloaded.hf_device_map.values())
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(offloaded.depth_attention_weights(ids),
                                   model.depth_attention_weights(ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_utils_checkpoint_from_outside(reentrant):
    """``torch.utils.checkpoint`` applied to every decoder layer from outside the model (as FSDP's or a user's
    wrapper does, not ``gradient_checkpointing_enable``): the layers keep no state between forward and
    recomputation, so the loss and every gradient equal the plain model's (float64). Without a KV cache, as
    transformers' own checkpointing sets (a recomputed attention would append to the cache a second time)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=3)).double().train()
    randomise_attnres(model)
    ids = torch.randint(3, 97, (2, 8))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_loss, plain = loss_and_grads()
    for layer in model.model.layers:
        forward = layer.forward
        layer.forward = lambda *args, _f=forward, **kwargs: checkpoint(  # tensors positional: reentrant passes grads
            functools.partial(_f, **kwargs), *args, use_reentrant=reentrant)
    loss, grads = loss_and_grads()
    assert torch.equal(loss, plain_loss)
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("block_size", [None, 3])
def test_forward_on_the_meta_device(block_size):
    """A model built and run on the meta device (to size and plan it, as a Llama can): the logits' shape, depth
    weights included (issue 19: before, the op's autocast query failed on 'meta')."""
    with torch.device("meta"):
        model = AttnResForCausalLM(tiny_config(attnres_block_size=block_size))
        ids = torch.ones(2, 5, dtype=torch.long)
        out = model.model(ids, output_depth_weights=True)
        logits = model(ids, labels=ids).logits
    assert logits.is_meta and logits.shape == (2, 5, 97)
    assert len(out.depth_weights) == 2 * LAYERS and all(w.is_meta for w in out.depth_weights)
