"""DenseFormer model: the k×p DWA against the paper's naive loop, identity init, HF behaviour."""

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaForCausalLM

from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM, DenseFormerModel
from depthfusion_hf.models.modeling_denseformer import dwa_sources
from depthfusion_hf.models.transformers_compat import enable_activation_checkpointing
from tests.causal_lm_checks import assert_a_few_adamw_steps_lower_the_loss
from tests.kernels._dwa_cases import rel_rms

from .helpers import randomise_dwa, tiny_config, tiny_llama_config


def naive_denseformer_logits(model: DenseFormerForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The paper's Listing 2, written independently of the model's forward (SDPA, causal, no padding)."""
    inner, cfg = model.model, model.config
    k, p = cfg.dwa_dilation, cfg.dwa_period
    x = inner.embed_tokens(input_ids)
    position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
    position_embeddings = inner.rotary_emb(x, position_ids=position_ids)
    all_previous_x = [x]
    alphas = iter(inner.dwa.alphas)
    for i in range(cfg.num_hidden_layers):
        x = inner.layers[i](x, attention_mask=None, position_embeddings=position_embeddings,
                            position_ids=position_ids)
        all_previous_x.append(x)
        if (i + 1) % p == 0:
            dilated = [x_ for j, x_ in enumerate(all_previous_x) if (len(all_previous_x) - 1 - j) % k == 0]
            x = sum(next(alphas) * x_ for x_ in dilated)
    assert next(alphas, None) is None, "every alpha must be used exactly once"
    return model.lm_head(inner.norm(x))


@pytest.mark.parametrize("k,p", [(1, 1), (2, 1), (1, 2), (4, 5), (3, 2), (6, 6)])
def test_matches_naive_loop(k, p):
    model = DenseFormerForCausalLM(tiny_config(dwa_dilation=k, dwa_period=p, attn_implementation="sdpa")).eval()
    randomise_dwa(model)
    ids = torch.randint(3, 97, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, naive_denseformer_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_sources_follow_the_formula():
    assert dwa_sources(5, 1) == [0, 1, 2, 3, 4, 5]
    assert dwa_sources(5, 4) == [1, 5]
    assert dwa_sources(8, 4) == [0, 4, 8]
    assert dwa_sources(10, 4) == [2, 6, 10]


@pytest.mark.parametrize("d", [1, 4, 6])
def test_parameter_count_1x1(d):
    model = DenseFormerModel(tiny_config(num_hidden_layers=d))
    assert model.dwa.alphas.numel() == d * (d + 3) // 2


def test_dwa_weights_matrix():
    model = DenseFormerForCausalLM(tiny_config(dwa_dilation=2, dwa_period=3))
    randomise_dwa(model)
    matrix = model.dwa_weights()
    assert matrix.shape == (6, 7)
    alphas = model.model.dwa.alphas.detach()
    torch.testing.assert_close(matrix[2, [1, 3]], alphas[:2])  # step 3 reads X_1, X_3
    torch.testing.assert_close(matrix[5, [0, 2, 4, 6]], alphas[2:])  # step 6 reads X_0, X_2, X_4, X_6
    assert matrix[0, 1] == 1 and matrix[0].abs().sum() == 1  # no step after block 1: identity row
    assert matrix[2, [0, 2]].abs().sum() == 0


def _identity(model):
    return torch.equal(model.model.dwa.alphas.detach(), model.model.dwa.identity_alphas())


def test_identity_init_survives_post_init_and_reinit():
    model = DenseFormerForCausalLM(tiny_config(dwa_dilation=2))
    assert _identity(model)
    with torch.no_grad():
        model.model.dwa.alphas.zero_()
    model._init_weights(model.model.dwa)  # what a user's re-initialisation calls
    assert _identity(model)
    with torch.no_grad():
        model.model.dwa.alphas.zero_()
    for module in model.modules():  # a full re-initialisation, as after to_empty()
        module._is_hf_initialized = False
    model.init_weights()
    assert _identity(model)


def test_identity_init_equals_llama():
    llama = LlamaForCausalLM(tiny_llama_config()).eval()
    dense = DenseFormerForCausalLM(tiny_config(dwa_dilation=1, dwa_period=1)).eval()
    missing = dense.load_state_dict(llama.state_dict(), strict=False).missing_keys
    assert missing == ["model.dwa.alphas"]
    ids = torch.randint(3, 97, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, llama(ids).logits, rtol=0, atol=1e-5)


def test_checkpoint_without_dwa_weights_loads_identity(tmp_path):
    model = DenseFormerForCausalLM(tiny_config(dwa_dilation=2, dwa_period=2))
    randomise_dwa(model)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.dwa.alphas"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = DenseFormerForCausalLM.from_pretrained(tmp_path)
    assert _identity(loaded)
    torch.testing.assert_close(loaded.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def test_save_load_identical_logits(tmp_path):
    model = DenseFormerForCausalLM(tiny_config(dwa_dilation=2, dwa_period=1)).eval()
    randomise_dwa(model)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, DenseFormerForCausalLM)
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_auto_classes_registered():
    fields = tiny_config().to_dict()
    fields.pop("model_type")
    config = AutoConfig.for_model("denseformer", **fields)
    assert isinstance(config, DenseFormerConfig)
    assert isinstance(AutoModel.from_config(config), DenseFormerModel)
    assert isinstance(AutoModelForCausalLM.from_config(config), DenseFormerForCausalLM)


def test_eager_and_sdpa_agree_with_padding():
    ids = torch.randint(3, 97, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    outs = []
    for impl in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = DenseFormerForCausalLM(tiny_config(attn_implementation=impl)).eval()
        randomise_dwa(model)
        with torch.no_grad():
            outs.append(model(ids, attention_mask=mask).logits)
    torch.testing.assert_close(outs[0][:, 3:], outs[1][:, 3:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-4)


def test_gradient_checkpointing_same_gradients():
    model = DenseFormerForCausalLM(tiny_config(dwa_dilation=2))
    randomise_dwa(model)
    ids = torch.randint(3, 97, (2, 8))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.train()
    plain = grads()
    enable_activation_checkpointing(model)
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys() and "model.dwa.alphas" in plain
    for name in plain:
        torch.testing.assert_close(plain[name], checkpointed[name], rtol=1e-5, atol=1e-6)


def test_bf16_forward_backward_matches_fp32():
    """A bf16 model against the same (bf16-rounded) weights computed in fp32.

    Bounds, with u = 2^-8 the bf16 unit roundoff: each of the ~15 roundings of an activation on the
    way to the logits adds a relative error of rms u / sqrt(3), independent ones add up to about
    sqrt(15) u / sqrt(3) ~ 2.2 u (measured: 1.9-2.4 u over four seeds), so the logits' rel-RMS stays
    below 4 u. Cross-entropy moves by at most 2 max|d logit| (it is 1-Lipschitz in each logit) plus one
    rounding of the loss. Gradients pass each block twice (forward and backward, ~70 roundings in all;
    measured <= 9 u for the worst parameter, 4.6 u for the DWA weights): below 16 u.
    """
    u = 2.0**-8
    torch.manual_seed(0)
    model = DenseFormerForCausalLM(tiny_config(dwa_dilation=2)).to(torch.bfloat16)
    randomise_dwa(model)
    reference = copy.deepcopy(model).float()
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    out, ref = model(ids, labels=ids), reference(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16
    assert rel_rms(out.logits, ref.logits) <= 4 * u
    max_logit_change = (out.logits.float() - ref.logits).abs().max().item()
    assert abs(out.loss.item() - ref.loss.item()) <= 2 * max_logit_change + u * ref.loss.item()
    out.loss.backward()
    ref.loss.backward()
    grads = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert grads[name].grad is not None, name
        assert rel_rms(grads[name].grad, p.grad) <= 16 * u, name


def test_loss_trains_dwa_weights():
    model = DenseFormerForCausalLM(tiny_config())
    assert_a_few_adamw_steps_lower_the_loss(model)
    assert not _identity(model)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("dwa_dilation", 0, r"`dwa_dilation` must be an integer in \[1, 6\]"),
        ("dwa_dilation", 7, r"`dwa_dilation` must be an integer in \[1, 6\]"),
        ("dwa_period", 0, r"`dwa_period` must be an integer in \[1, 6\]"),
        ("dwa_period", 99, r"`dwa_period` must be an integer in \[1, 6\]"),
        ("dwa_period", 2.5, r"`dwa_period`"),
        ("num_hidden_layers", 0, r"`num_hidden_layers` must be an integer >= 1"),
        ("hidden_size", 50, r"`hidden_size` \(50\) must be divisible by `num_attention_heads` \(4\)"),
        ("num_key_value_heads", 3, r"multiple of `num_key_value_heads` \(3\)"),
        ("num_key_value_heads", 8, r"`num_key_value_heads` must be an integer in \[1, 4\]"),
        ("vocab_size", -1, r"`vocab_size` must be an integer >= 1"),
    ],
)
def test_invalid_config(field, value, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**{field: value})


def test_model_follows_the_backend_environment_variable(monkeypatch):
    model = DenseFormerForCausalLM(tiny_config(dwa_dilation=2)).eval()
    randomise_dwa(model)
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        fast = model(ids).logits
        monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
        torch.testing.assert_close(model(ids).logits, fast, rtol=1e-5, atol=1e-5)
        monkeypatch.setenv("DEPTHFUSION_BACKEND", "gpu-please")
        with pytest.raises(ValueError, match="backend must be one of"):
            model(ids)
