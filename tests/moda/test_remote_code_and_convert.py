"""Remote-code export (fresh process, no depthfusion_hf, no Triton, offline) and the Llama warm start."""

import pytest
import torch
from transformers import LlamaForCausalLM

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
    for name in ("configuration_moda.py", "modeling_moda.py", "moda_attention.py", "model.safetensors"):
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
    with torch.no_grad():
        logits = moda(ids).logits
    assert torch.isfinite(logits).all()
    assert (logits - llama(ids).logits).abs().max() > 0  # depth entries join the softmax: not equal to Llama


def test_warm_start_rejects_bad_input():
    with pytest.raises(ValueError, match="ffn_kv_init must be one of"):
        llama_to_moda(LlamaForCausalLM(tiny_llama_config()), ffn_kv_init="random")
    with pytest.raises(ValueError, match="expected a LlamaForCausalLM"):
        llama_to_moda(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="norm_position must be 'pre'"):
        llama_to_moda(LlamaForCausalLM(tiny_llama_config()), norm_position="post")
