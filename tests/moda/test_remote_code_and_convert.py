"""Remote-code export (fresh process, no depthfusion_hf, no Triton, offline) and the Llama warm start."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from depthfusion_hf import MoDAConfig, MoDAForCausalLM
from depthfusion_hf.convert import llama_to_moda
from tests.fresh_process import run_fresh

from .helpers import tiny_llama_config, tiny_model


def test_remote_code_loads_in_fresh_process(tmp_path):
    model = tiny_model(norm_position="post")
    MoDAConfig.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    folder = tmp_path / "export"
    model.save_pretrained(folder)
    for name in ("configuration_moda.py", "modeling_moda.py", "moda_attention.py", "moda_torch.py", "moda_triton.py",
                 "model.safetensors"):
        assert (folder / name).exists(), name
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        expected = {"ids": ids, "logits": model(ids).logits, "generated": model.generate(
            ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)}
    torch.save(expected, tmp_path / "expected.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_fresh(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__name__ == "MoDAForCausalLM", type(model)
        assert "depthfusion_hf" not in type(model).__module__
        with torch.no_grad():
            diff = (model(expected["ids"]).logits - expected["logits"]).abs().max().item()
            generated = model.generate(expected["ids"][:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0,
                                       eos_token_id=None)
        print("DIFF", diff, "SAME_GENERATION", bool(torch.equal(generated, expected["generated"])))
        """,
        cwd=str(elsewhere),
        hf_home=str(tmp_path / "hf_home"),
    )
    assert float(out.split("DIFF")[1].split()[0]) <= 1e-6  # memory-mapped weights may round differently
    assert "SAME_GENERATION True" in out


def test_llama_warm_start_copies_weights_and_is_exact_for_one_layer(tmp_path):
    llama = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1)).eval()
    moda = llama_to_moda(llama)
    assert isinstance(moda, MoDAForCausalLM) and not moda.training
    ids = torch.randint(3, 97, (2, 10))
    with torch.no_grad():
        # One layer reads no depth entry (and the last layer writes no FFN entry): MoDA == Llama.
        torch.testing.assert_close(moda(ids).logits, llama(ids).logits, rtol=1e-5, atol=1e-5)
    llama.save_pretrained(tmp_path / "llama")
    from_folder = llama_to_moda(tmp_path / "llama")
    with torch.no_grad():
        torch.testing.assert_close(from_folder.eval()(ids).logits, llama(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", ["zero", "zero_value", "copy_kv"])
def test_llama_warm_start_ffn_kv_rules(rule):
    llama = LlamaForCausalLM(tiny_llama_config()).eval()
    moda = llama_to_moda(llama, ffn_kv_init=rule)
    moda_state, llama_state = moda.state_dict(), llama.state_dict()
    for name, weight in llama_state.items():
        assert torch.equal(moda_state[name], weight), name
    layer = moda.model.layers[1]
    weight = layer.ffn_kv_proj.weight.view(2, 2, 12, 48)  # (Hkv, key/value, d, D)
    attn = layer.self_attn
    expected_key = attn.k_proj.weight.view(2, 12, 48) if rule != "zero" else torch.zeros(2, 12, 48)
    expected_value = attn.v_proj.weight.view(2, 12, 48) if rule == "copy_kv" else torch.zeros(2, 12, 48)
    assert torch.equal(weight[:, 0], expected_key) and torch.equal(weight[:, 1], expected_value)
    ids = torch.randint(3, 97, (2, 10))
    ungated = llama_to_moda(llama, ffn_kv_init=rule, depth_gate=False)
    with torch.no_grad():
        logits, ungated_logits, want = moda(ids).logits, ungated(ids).logits, llama(ids).logits
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)  # closed gates: the Llama
    assert torch.isfinite(ungated_logits).all()
    assert (ungated_logits - want).abs().max() > 1e-2  # the paper's MoDA: depth entries join the softmax at once


def test_warm_start_rejects_bad_input():
    with pytest.raises(ValueError, match="ffn_kv_init must be one of"):
        llama_to_moda(LlamaForCausalLM(tiny_llama_config()), ffn_kv_init="random")
    with pytest.raises(ValueError, match="expected a LlamaForCausalLM"):
        llama_to_moda(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="norm_position must be 'pre'"):
        llama_to_moda(LlamaForCausalLM(tiny_llama_config()), norm_position="post")


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
