"""MHCModel / MHCForCausalLM: the forward is DeepSeek-V4's hyper-connections around Llama blocks (float64, built from
transformers' own modules), the backends agree, init, float32 hyper-connection parameters, hidden states, the
analysis weights, autocast / bf16 / inference_mode, gradient checkpointing, save / load and bad inputs."""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from depthfusion_hf.models.configuration_mhc import MHCConfig
from depthfusion_hf.models.modeling_mhc import MHCForCausalLM, MHCHyperConnection, MHCHyperHead, MHCModel
from depthfusion_hf.models.transformers_compat import enable_activation_checkpointing
from tests.causal_lm_checks import assert_a_few_adamw_steps_lower_the_loss

from .helpers import EPS, float_keeps_float64, max_rel, randomise_mhc, tiny_config, transformers_modules

EPS64 = EPS[torch.float64]


def float64_model(**overrides) -> MHCForCausalLM:
    torch.manual_seed(0)
    return randomise_mhc(MHCForCausalLM(tiny_config(**overrides))).double().eval()


def deepseek_v4_forward(model: MHCForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The logits as DeepSeek-V4 computes them (``DeepseekV4DecoderLayer.forward``, ``DeepseekV4Model.forward``), with
    transformers' ``DeepseekV4HyperConnection`` / ``HyperHead`` holding the model's parameters and the model's own
    Llama attention, MLP and norms (float64; causal attention, no padding)."""
    config = model.config
    n, dim = config.hc_mult, config.hidden_size
    inner = model.model
    embeds = inner.embed_tokens(ids)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    rotary = inner.rotary_emb(embeds, position_ids=positions)
    streams = embeds.unsqueeze(2).expand(-1, -1, n, -1).contiguous()
    head_params = list(inner.hc_head.parameters())

    def mix(streams, output, post, comb):
        return post.unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)

    with float_keeps_float64():
        for layer in inner.layers:
            for connection, sublayer in ((layer.attn_hc, "attn"), (layer.ffn_hc, "mlp")):
                theirs, _ = transformers_modules(n, dim, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps,
                                                 *connection.parameters(), *head_params)
                post, comb, collapsed = theirs.double()(streams)
                if sublayer == "attn":
                    output, _ = layer.self_attn(layer.input_layernorm(collapsed), position_embeddings=rotary,
                                                attention_mask=None)
                else:
                    output = layer.mlp(layer.post_attention_layernorm(collapsed))
                streams = mix(streams, output, post, comb)
        _, head = transformers_modules(n, dim, 1, config.hc_eps, config.rms_norm_eps,
                                       *layer.attn_hc.parameters(), *head_params)
        hidden = inner.norm(head.double()(streams))
    return model.lm_head(hidden)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_logits_are_deepseek_v4_hyper_connections_around_llama_blocks(backend, n):
    model = float64_model(hc_mult=n, op_backend=backend)
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = deepseek_v4_forward(model, ids)
    assert max_rel(got, want) <= 1e3 * EPS64


def test_backends_agree_on_loss_and_every_gradient_in_float64():
    ids = torch.randint(3, 97, (2, 8))
    results = []
    for backend in ("reference", "torch"):
        model = float64_model(op_backend=backend).train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    assert abs(results[1][0] - results[0][0]) <= 64 * EPS64 * abs(results[0][0])
    for name, grad in results[0][1].items():
        assert max_rel(results[1][1][name], grad) <= 1e4 * EPS64, name


def test_init_is_transformers_deepseek_v4s():
    torch.manual_seed(0)
    config = tiny_config(initializer_range=0.05)
    model = MHCForCausalLM(config)
    connections = [m for m in model.modules() if isinstance(m, MHCHyperConnection)]
    assert len(connections) == 2 * config.num_hidden_layers
    for module in connections:
        assert module.fn.shape == ((2 + 4) * 4, 4 * 48)
        assert abs(module.fn.std().item() - 0.05) < 0.005 and abs(module.fn.mean().item()) < 0.005
        assert torch.equal(module.base, torch.zeros(24)) and torch.equal(module.scale, torch.ones(3))
    head = model.model.hc_head
    assert abs(head.hc_fn.std().item() - 0.05) < 0.01
    assert torch.equal(head.hc_base, torch.zeros(4)) and torch.equal(head.hc_scale, torch.ones(1))


def test_missing_hyper_connection_weights_are_initialised_and_loaded_ones_kept(tmp_path):
    model = randomise_mhc(MHCForCausalLM(tiny_config()))
    model.save_pretrained(tmp_path / "full")
    loaded = MHCForCausalLM.from_pretrained(tmp_path / "full")
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    state = {k: v for k, v in model.state_dict().items() if ".attn_hc." not in k}
    model.save_pretrained(tmp_path / "partial", state_dict=state)
    partial = MHCForCausalLM.from_pretrained(tmp_path / "partial")
    for layer in partial.model.layers:
        assert torch.equal(layer.attn_hc.base, torch.zeros(24)) and torch.equal(layer.attn_hc.scale, torch.ones(3))
        assert 0.01 < layer.attn_hc.fn.std().item() < 0.03
    assert torch.equal(partial.model.layers[0].ffn_hc.base, model.model.layers[0].ffn_hc.base)


def test_hyper_connection_parameters_stay_float32_in_a_bf16_model(tmp_path):
    """from_config / from_pretrained with dtype=bfloat16: Llama weights bf16, hyper-connections fp32; the forward
    runs (bf16 streams, fp32 weights) and gives bf16 logits."""
    model = randomise_mhc(MHCForCausalLM(tiny_config()))
    model.save_pretrained(tmp_path / "model")
    for bf16 in (AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.bfloat16),
                 AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.bfloat16)):
        dtypes = {name: p.dtype for name, p in bf16.named_parameters()}
        hc = {name for name in dtypes if "_hc." in name or "hc_head." in name}
        assert hc and all(dtypes[name] == torch.float32 for name in hc)
        assert all(dtype == torch.bfloat16 for name, dtype in dtypes.items() if name not in hc)
        ids = torch.randint(3, 97, (2, 6))
        out = bf16(input_ids=ids, labels=ids)
        assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
        out.loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in bf16.parameters())


def test_autocast_keeps_fp32_streams_and_trains():
    """Under bf16 autocast an fp32 model's streams stay fp32 (as a Llama's residual does) and every gradient is
    finite; the loss is the fp32 model's to bf16 accuracy."""
    model = randomise_mhc(MHCForCausalLM(tiny_config())).train()
    ids = torch.randint(3, 97, (2, 8))
    seen = []
    handle = model.model.layers[1].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    handle.remove()
    loss.backward()
    assert seen == [torch.float32]
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        exact = model(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - exact.item()) < 0.02 * exact.item()


def test_inference_mode_and_a_bf16_model_generate():
    model = randomise_mhc(MHCForCausalLM(tiny_config())).eval()
    ids = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
    with torch.inference_mode():
        got = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
    bf16 = model.to(torch.bfloat16)
    with torch.inference_mode():
        assert bf16.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 9)


def test_output_hidden_states_are_the_streams_then_the_final_state():
    model = float64_model()
    ids = torch.randint(3, 97, (2, 6))
    out = model(input_ids=ids, output_hidden_states=True)
    layers = model.config.num_hidden_layers
    assert len(out.hidden_states) == layers + 1
    embeds = model.model.embed_tokens(ids)
    assert torch.equal(out.hidden_states[0], embeds.unsqueeze(2).expand(-1, -1, 4, -1))
    assert all(h.shape == (2, 6, 4, 48) for h in out.hidden_states[:-1])
    base = model.model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(out.hidden_states[-1], base.last_hidden_state) and base.last_hidden_state.shape == (2, 6, 48)


def test_hyper_connection_weights_average_over_real_tokens():
    """Right padding leaves the real tokens' computation unchanged (causal attention): the masked average over
    the padded batch is the average over the unpadded sequence."""
    model = float64_model()
    ids = torch.randint(3, 97, (1, 7))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 7), torch.zeros(1, 3)], dim=1).long()
    want = model.hyper_connection_weights(ids)
    got = model.hyper_connection_weights(padded, attention_mask=mask)
    shapes = {"pre": (3, 2, 4), "post": (3, 2, 4), "comb": (3, 2, 4, 4), "head": (4,)}
    for key, shape in shapes.items():
        assert got[key].shape == shape and got[key].dtype == torch.float32 and got[key].device.type == "cpu"
        assert torch.allclose(got[key], want[key], rtol=1e-6, atol=0), key
    assert not torch.allclose(model.hyper_connection_weights(padded)["pre"], want["pre"], rtol=1e-4, atol=0)
    assert ((want["comb"].sum(-2) - 1).abs() < 1e-5).all()  # each token's comb: columns sum to 1 - O(eps)
    assert ((want["post"] > 0) & (want["post"] < 2)).all() and (want["pre"] > 0).all()


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(reentrant):
    ids = torch.randint(3, 97, (2, 8))
    results = []
    for checkpointing in (False, True):
        model = float64_model().train()
        if checkpointing:
            enable_activation_checkpointing(model, {"use_reentrant": reentrant})
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert abs(results[1][0] - results[0][0]) <= 16 * EPS64 * abs(results[0][0])
    for got, want in zip(results[1][1], results[0][1]):
        assert max_rel(got, want) <= 64 * EPS64


def test_save_load_and_auto_classes(tmp_path):
    model = randomise_mhc(MHCForCausalLM(tiny_config())).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 97, (2, 6))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is MHCForCausalLM
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is MHCModel and isinstance(base.hc_head, MHCHyperHead)


def test_inputs_embeds_one_token_and_a_single_stream():
    model = float64_model(hc_mult=1)
    ids = torch.randint(3, 97, (2, 1))
    with torch.no_grad():
        by_ids = model(input_ids=ids).logits
        by_embeds = model(inputs_embeds=model.model.embed_tokens(ids)).logits
    assert by_ids.shape == (2, 1, 97) and torch.equal(by_ids, by_embeds)


def test_training_lowers_the_loss():
    torch.manual_seed(0)
    assert_a_few_adamw_steps_lower_the_loss(MHCForCausalLM(tiny_config()).train())


def test_bad_inputs_and_configs_are_rejected():
    model = MHCForCausalLM(tiny_config())
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        model(input_ids=torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=97\)"):
        model(input_ids=torch.tensor([[1, 97]]))
    config = tiny_config()
    config.hc_mult = 0
    with pytest.raises(ValueError, match="`hc_mult` must be an integer >= 1"):
        MHCForCausalLM(config)
    with pytest.raises(ValueError, match="`hc_eps` must be a finite number > 0"):
        MHCConfig(hc_eps=-1e-6)
    with pytest.raises(ValueError, match="nearest valid name is `hc_sinkhorn_iters`"):
        MHCConfig(hc_sinkhorn_iter=3)
