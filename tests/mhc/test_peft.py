"""LoRA (PEFT) on mHC: the Llama projections as LoRA targets, the hyper-connections trained in full through
``modules_to_save``; adapter save / load and ``merge_and_unload`` give the adapted logits."""

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from depthfusion_hf.models.mhc import MHCForCausalLM

from .helpers import randomise_mhc, tiny_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAVED = ["attn_hc", "ffn_hc", "hc_head"]  # every hyper-connection (fn, base, scale) and the head


def build() -> MHCForCausalLM:
    torch.manual_seed(0)
    return randomise_mhc(MHCForCausalLM(tiny_config())).eval()


def lora(model, modules_to_save=SAVED):
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                            target_modules=TARGETS, modules_to_save=modules_to_save))


def ids_batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(seed))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def train_a_little(model, steps: int = 3) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(steps):
        ids = ids_batch(10 + step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def test_only_lora_and_hyper_connections_are_trainable_and_get_gradients():
    model = lora(build())
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    lora_names = [n for n in trainable if ".lora_A." in n or ".lora_B." in n]
    saved = [n for n in trainable if ".modules_to_save." in n]
    assert sorted(lora_names + saved) == sorted(trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora_names} == set(TARGETS)
    assert len(saved) == 3 * 2 * 3 + 3  # fn, base, scale of both hyper-connections in 3 layers, and the head's
    ids = ids_batch()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(trainable[n].grad is not None and trainable[n].grad.abs().sum() > 0 for n in saved)


def test_adapter_save_load_and_merge_give_identical_logits(tmp_path):
    model = lora(build())
    ids = ids_batch(3)
    with model.disable_adapter():
        base_logits = logits(model, ids)
    wrapper = model.base_model.model.model.layers[1].ffn_hc
    original_fn = wrapper.original_module.fn.detach().clone()
    train_a_little(model)
    adapted = logits(model, ids)
    assert not torch.allclose(adapted, base_logits, atol=1e-4)
    assert torch.equal(wrapper.original_module.fn, original_fn)  # the base hyper-connection is frozen ...
    assert not torch.equal(wrapper.modules_to_save["default"].fn, original_fn)  # ... its copy trained

    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any("lora_B" in k for k in saved) and any(k.endswith("ffn_hc.fn") for k in saved)
    reloaded = PeftModel.from_pretrained(build(), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(reloaded, ids), adapted, rtol=0, atol=0)

    merged = reloaded.merge_and_unload()
    assert type(merged) is MHCForCausalLM
    assert not any("lora" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, ids), adapted, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval(), ids),
                               logits(merged, ids), rtol=1e-6, atol=1e-6)


def test_lora_on_q_and_v_only_leaves_the_hyper_connections_frozen():
    model = get_peft_model(build(), LoraConfig(r=2, lora_alpha=4, task_type="CAUSAL_LM",
                                               target_modules=["q_proj", "v_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(("q_proj.lora_" in n or "v_proj.lora_" in n) for n in trainable)
    before = logits(model, ids_batch())
    train_a_little(model)
    assert not torch.allclose(logits(model, ids_batch()), before, atol=1e-5)
