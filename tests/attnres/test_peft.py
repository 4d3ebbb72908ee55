"""LoRA (PEFT) on AttnRes: the Llama projections as LoRA targets, the AttnRes calls trained in full through
``modules_to_save``; adapter save/load and ``merge_and_unload`` give the adapted logits."""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from depthfusion_hf.models.attnres import AttnResForCausalLM

from .helpers import randomise_attnres, tiny_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAVED = ["mlp_res", "output_res"]  # every AttnRes call (pseudo-query + key-norm weight)


def build() -> AttnResForCausalLM:
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=3))
    randomise_attnres(model)
    return model.eval()


def lora(model: AttnResForCausalLM, modules_to_save=SAVED):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=TARGETS,
                        modules_to_save=modules_to_save)
    return get_peft_model(model, config)


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


def test_only_lora_and_attnres_calls_are_trainable_and_get_gradients():
    model = lora(build())
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    lora_names = [n for n in trainable if ".lora_A." in n or ".lora_B." in n]
    saved = [n for n in trainable if ".modules_to_save." in n]
    assert sorted(lora_names + saved) == sorted(trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora_names} == set(TARGETS)
    assert len(saved) == 2 * 2 * 4  # query + key-norm weight of both calls in each of the 4 layers
    ids = ids_batch()
    model(input_ids=ids, labels=ids).loss.backward()
    for name in saved + [n for n in lora_names if ".lora_B." in n]:
        assert trainable[name].grad is not None, name
    assert all(trainable[n].grad.abs().sum() > 0 for n in saved)


def test_adapter_save_load_and_merge_give_identical_logits(tmp_path):
    model = lora(build())
    ids = ids_batch(3)
    with model.disable_adapter():
        base_logits = logits(model, ids)
    original_query = model.base_model.model.model.layers[2].mlp_res.original_module.query.detach().clone()
    train_a_little(model)
    adapted = logits(model, ids)
    assert not torch.allclose(adapted, base_logits, atol=1e-4)
    wrapper = model.base_model.model.model.layers[2].mlp_res
    assert torch.equal(wrapper.original_module.query, original_query)  # the base call is frozen ...
    assert not torch.equal(wrapper.modules_to_save["default"].query, original_query)  # ... its copy trained

    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any("lora_B" in k for k in saved) and any(k.endswith("mlp_res.query") for k in saved)
    reloaded = PeftModel.from_pretrained(build(), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(reloaded, ids), adapted, rtol=0, atol=0)

    merged = reloaded.merge_and_unload()
    assert type(merged) is AttnResForCausalLM
    assert not any("lora" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, ids), adapted, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval(), ids),
                               logits(merged, ids), rtol=1e-6, atol=1e-6)


def test_lora_on_q_and_v_only_leaves_the_attnres_calls_frozen():
    model = get_peft_model(build(), LoraConfig(r=2, lora_alpha=4, task_type="CAUSAL_LM",
                                               target_modules=["q_proj", "v_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(("q_proj.lora_" in n or "v_proj.lora_" in n) for n in trainable)
    before = logits(model, ids_batch())
    train_a_little(model)
    assert not torch.allclose(logits(model, ids_batch()), before, atol=1e-5)
