"""MoDA conversion with depth gates (issue 28): closed gates make the converted model the Llama, and they learn."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from depthfusion_hf import MoDAForCausalLM
from depthfusion_hf.convert import llama_to_moda

from .helpers import tiny_llama_config


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("size", ["tiny", "real"])
def test_converted_model_equals_the_llama_and_its_gates_learn(attn_implementation, size):
    """Issue 28: closed depth gates make the converted MoDA the Llama (float32 rounding), with left padding (real
    tokens compared: a padding row's value is the mean of masked keys, which eager Llama takes over the future keys
    too) and at the real size of SmolLM2-135M (hidden 576, 9 / 3 heads, intermediate 1536, vocabulary 49,152; 2
    layers, random weights); every gate gets a finite, non-zero gradient."""
    if size == "tiny":
        config = tiny_llama_config(attn_implementation=attn_implementation)
    else:
        config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                             vocab_size=49152, num_hidden_layers=2, tie_word_embeddings=True,
                             attn_implementation=attn_implementation)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(config).eval()
    moda = llama_to_moda(llama)
    assert moda.config.moda_depth_gate and moda.config.moda_depth_gate_init == 0.0
    assert moda.model.layers[0].self_attn.depth_gate is None  # layer 0 reads no depth entry
    ids = torch.randint(3, config.vocab_size, (2, 12))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :4] = 0
    with torch.no_grad():
        want = llama(ids, attention_mask=attention_mask).logits
        got = moda(ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, 4:], want[1, 4:], rtol=1e-5, atol=1e-5)
    moda.train()
    moda(ids, labels=ids).loss.backward()
    for layer in moda.model.layers[1:]:
        grad = layer.self_attn.depth_gate.grad
        assert torch.isfinite(grad).all() and grad.abs().min() > 0, grad


def test_calibrated_gates_give_every_head_the_same_depth_share_per_gate_unit():
    """calibrate_depth_gates: log-scale = -median log(Z_d / Z_s) per head, measured at the closed model's states, so
    that with every gate at a small u the median token of the calibration text puts about u of its mass on depth,
    in every head (uncalibrated heads differ by orders of magnitude); the conversion stays exact."""
    llama = LlamaForCausalLM(tiny_llama_config()).eval()
    calibration = torch.randint(3, 97, (1, 15), generator=torch.Generator().manual_seed(4))
    moda = llama_to_moda(llama, calibration_ids=calibration)
    ids = torch.randint(3, 97, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(moda(ids).logits, llama(ids).logits, rtol=1e-5, atol=1e-5)
        log_scales = torch.stack([layer.self_attn.depth_gate_log_scale for layer in moda.model.layers[1:]])
        assert torch.isfinite(log_scales).all() and log_scales.abs().min() > 0
        for layer in moda.model.layers[1:]:
            layer.self_attn.depth_gate.fill_(1e-3)
        attentions = moda.model(calibration, output_attentions=True).attentions
    for weights in attentions[1:]:
        median_share = weights[0, :, :, 15:].sum(-1).median(dim=-1).values  # [Hq]
        torch.testing.assert_close(median_share, torch.full_like(median_share, 1e-3 / (1 + 1e-3)), rtol=2e-2, atol=0)
    with pytest.raises(ValueError, match="depth_gate=True"):
        llama_to_moda(llama, depth_gate=False, calibration_ids=calibration)
    with pytest.raises(ValueError, match="integer tensor"):
        llama_to_moda(llama, calibration_ids=torch.rand(1, 5))


def test_converted_gates_survive_save_and_load(tmp_path):
    llama = LlamaForCausalLM(tiny_llama_config()).eval()
    moda = llama_to_moda(llama, calibration_ids=torch.randint(3, 97, (1, 9)))
    with torch.no_grad():
        moda.model.layers[2].self_attn.depth_gate[1] = 0.25
    moda.save_pretrained(tmp_path / "moda")
    loaded = MoDAForCausalLM.from_pretrained(tmp_path / "moda")
    for layer, loaded_layer in zip(moda.model.layers[1:], loaded.model.layers[1:]):
        assert torch.equal(layer.self_attn.depth_gate, loaded_layer.self_attn.depth_gate)
        assert torch.equal(layer.self_attn.depth_gate_log_scale, loaded_layer.self_attn.depth_gate_log_scale)
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).logits, moda.eval()(ids).logits, rtol=0, atol=0)


def test_warm_start_rejects_a_gate_that_is_not_a_bool():
    with pytest.raises(ValueError, match="depth_gate must be a bool"):
        llama_to_moda(LlamaForCausalLM(tiny_llama_config()), depth_gate="closed")
