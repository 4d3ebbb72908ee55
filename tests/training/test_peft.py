"""LoRA (PEFT) on every family: trainable parameters, adapter save/load, merge_and_unload.

The target modules are the ones ``docs/PEFT.md`` documents; the depth-fusion modules (DenseFormer's DWA weights
``model.dwa``, AttnRes's calls, mHC's hyper-connections and head, the DWAtt fusion head and classifier) are
trained in full through ``modules_to_save``.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from .builders import tiny_attnres, tiny_denseformer, tiny_dwatt, tiny_mhc, tiny_moda, token_batch

DECODER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SETUPS = {
    "denseformer": dict(build=tiny_denseformer, task_type="CAUSAL_LM", target_modules=DECODER_TARGETS,
                        modules_to_save=["dwa"], full=["model.dwa"]),
    "moda": dict(build=tiny_moda, task_type="CAUSAL_LM", target_modules=DECODER_TARGETS + ["ffn_kv_proj"],
                 modules_to_save=None, full=[]),
    "attnres": dict(build=tiny_attnres, task_type="CAUSAL_LM", target_modules=DECODER_TARGETS,
                    modules_to_save=["mlp_res", "output_res"],
                    full=[f"model.layers.{i}.{call}" for i in range(4) for call in ("mlp_res", "output_res")]),
    "mhc": dict(build=tiny_mhc, task_type="CAUSAL_LM", target_modules=DECODER_TARGETS,
                modules_to_save=["attn_hc", "ffn_hc", "hc_head"],
                full=[f"model.layers.{i}.{hc}" for i in range(4) for hc in ("attn_hc", "ffn_hc")] + ["model.hc_head"]),
    "dwatt": dict(build=tiny_dwatt, task_type="TOKEN_CLS", target_modules=["query", "key", "value"],
                  modules_to_save=["fusion", "classifier"], full=["fusion", "classifier"]),
}


def lora_model(family: str):
    """The family's tiny model wrapped with the documented LoRA config (r=4)."""
    setup = SETUPS[family]
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type=setup["task_type"],
                        target_modules=setup["target_modules"], modules_to_save=setup["modules_to_save"])
    return get_peft_model(setup["build"](), config)


def train_a_little(model, steps: int = 3) -> None:
    """A few AdamW steps on random tokens so LoRA B, the DWA weights and the heads move off their init."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(steps):
        ids = token_batch(100, seed=10 + step)
        labels = ids if model.peft_config["default"].task_type == "CAUSAL_LM" else ids % 5
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def base_name(peft_name: str) -> str:
    """``base_model.model.X.lora_A.default.weight`` -> ``X`` (the wrapped module's name)."""
    name = peft_name.removeprefix("base_model.model.")
    for marker in (".lora_A", ".lora_B", ".modules_to_save"):
        name = name.split(marker)[0]
    return name


@pytest.mark.parametrize("family", list(SETUPS))
def test_only_lora_and_saved_modules_are_trainable(family):
    model = lora_model(family)
    setup = SETUPS[family]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    lora = [n for n in trainable if ".lora_A." in n or ".lora_B." in n]
    full = [n for n in trainable if ".modules_to_save." in n]
    assert sorted(lora + full) == sorted(trainable)
    wrapped = {base_name(n).rsplit(".", 1)[-1] for n in lora}
    assert wrapped == set(setup["target_modules"])
    if family != "dwatt":  # every block's projections carry LoRA (MoDA: FFN-KV in all but the last block)
        layers = {base_name(n).split(".")[2] for n in lora}
        assert layers == {"0", "1", "2", "3"}
    if family == "moda":
        ffn_kv = {base_name(n) for n in lora if "ffn_kv_proj" in n}
        assert ffn_kv == {f"model.layers.{i}.ffn_kv_proj" for i in range(3)}
    assert {base_name(n) for n in full} == set(setup["full"])
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert any("embed" in n for n in frozen)
    # Gradients reach the LoRA factors and the fully trained modules.
    ids = token_batch(100)
    labels = ids if family != "dwatt" else ids % 5
    model(input_ids=ids, labels=labels).loss.backward()
    for name in (lora[0], lora[-1], *full):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0 or ".lora_A." in name, name


@pytest.mark.parametrize("family", list(SETUPS))
def test_adapter_save_load_and_merge_give_identical_logits(family, tmp_path):
    model = lora_model(family)
    ids = token_batch(100, seed=3)
    with model.disable_adapter():
        base_logits = logits(model, ids)
    train_a_little(model)
    adapted = logits(model, ids)
    assert not torch.allclose(adapted, base_logits, atol=1e-4)  # the adapter changed the model

    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any("lora_B" in k for k in saved)
    if family == "denseformer":
        dwa_keys = [k for k in saved if ".dwa." in k]
        assert dwa_keys and "alphas" in dwa_keys[0]
    for module in SETUPS[family]["full"]:  # every fully trained module's weights are in the adapter file
        assert any(f"{module}." in k for k in saved), module

    fresh = SETUPS[family]["build"]()  # the same seed: the same base weights
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(reloaded, ids), adapted, rtol=0, atol=0)

    merged = reloaded.merge_and_unload()
    assert type(merged) is type(SETUPS[family]["build"]())
    assert not any("lora" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, ids), adapted, rtol=1e-5, atol=1e-5)

    merged.save_pretrained(tmp_path / "merged")
    auto = AutoModelForTokenClassification if family == "dwatt" else AutoModelForCausalLM
    # Not bitwise: weights loaded from safetensors can take other (alignment-dependent) CPU kernel paths.
    torch.testing.assert_close(logits(auto.from_pretrained(tmp_path / "merged").eval(), ids), logits(merged, ids),
                               rtol=1e-6, atol=1e-6)


def test_dwa_weights_train_through_modules_to_save():
    model = lora_model("denseformer")
    wrapper = model.base_model.model.model.dwa
    original = wrapper.original_module.alphas.detach().clone()
    train_a_little(model)
    copy = wrapper.modules_to_save["default"].alphas
    assert not torch.equal(copy, original)  # the copy trained ...
    assert torch.equal(wrapper.original_module.alphas, original)  # ... the base weights did not
    merged = model.merge_and_unload()
    torch.testing.assert_close(merged.model.dwa.alphas, copy)
    start = merged.model.dwa.offsets[2]  # the dense view reads the trained weights: row of block 2 = alpha[2, 0..2]
    torch.testing.assert_close(merged.dwa_weights()[1, :3], copy.detach()[start : start + 3])


@pytest.mark.parametrize("family", ["attnres", "mhc"])
def test_depth_modules_train_through_modules_to_save_and_the_base_stays_frozen(family):
    model = lora_model(family)
    name = SETUPS[family]["full"][-1]
    wrapper = model.get_submodule(f"base_model.model.{name}")
    original = {k: p.detach().clone() for k, p in wrapper.original_module.named_parameters()}
    train_a_little(model)
    copy = dict(wrapper.modules_to_save["default"].named_parameters())
    assert all(torch.equal(p, original[k]) for k, p in wrapper.original_module.named_parameters())
    assert any(not torch.equal(copy[k], original[k]) for k in original)  # the copy trained
    merged = model.merge_and_unload()
    for k, p in merged.get_submodule(name).named_parameters():
        torch.testing.assert_close(p, copy[k])


@pytest.mark.parametrize("family", ["attnres", "mhc"])
def test_lora_on_q_and_v_only_leaves_the_depth_modules_frozen(family):
    model = get_peft_model(SETUPS[family]["build"](), LoraConfig(r=2, lora_alpha=4, task_type="CAUSAL_LM",
                                                                 target_modules=["q_proj", "v_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(("q_proj.lora_" in n or "v_proj.lora_" in n) for n in trainable)
    ids = token_batch(100)
    before = logits(model, ids)
    train_a_little(model)
    assert not torch.allclose(logits(model, ids), before, atol=1e-5)
