"""The upcycling study (issue 12 §2): a tiny pre-trained Llama continued as itself and upcycled, for real, plus the
separate learning rate of the new parameters and the validation-only choice of it."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from depthfusion_hf.convert import llama_to_denseformer
from depthfusion_hf.data.corpus import load_kjv_chapters
from depthfusion_hf.recipes.clm import DepthFusionTrainer, new_parameter_names
from depthfusion_hf.recipes.study.tables import best_scales

from .test_compare_families import load_script

REPO = Path(__file__).resolve().parents[2]


def test_new_parameters_get_their_own_learning_rate(tmp_path):
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=50))
    model = llama_to_denseformer(llama)
    new = new_parameter_names(model, llama.state_dict())
    assert new == ["model.dwa.alphas"]
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, weight_decay=0.1, report_to="none",
                             use_cpu=True)
    optimizer = DepthFusionTrainer(model=model, args=args, new_names=new, new_param_lr_scale=10.0).create_optimizer()
    alphas = model.model.dwa.alphas
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert lr_of[id(alphas)] == pytest.approx(1e-2, rel=1e-12) and decay_of[id(alphas)] == 0.0
    others = [p for p in model.parameters() if p is not alphas]
    assert {lr_of[id(p)] for p in others} == {1e-3}
    assert len(lr_of) == len(list(model.parameters()))  # every parameter in exactly one group
    plain = DepthFusionTrainer(model=model, args=args, new_names=new, new_param_lr_scale=1.0).create_optimizer()
    assert len(plain.param_groups) == 2


def test_the_lr_scale_is_chosen_on_validation_not_test():
    def run(scale, seed, val, test):
        return {"spec": "moda", "lr_scale": scale, "seed": seed, "eval_loss": val, "name": "moda", "parameters": 1,
                "curve": [{"step": 0, "seconds": 0.0, "eval_loss": 9.0}], "extra": {"test_loss": test}}

    records = [run(1.0, 0, 4.0, 3.0), run(1.0, 1, 4.2, 3.0), run(10.0, 0, 4.1, 5.0), run(10.0, 1, 4.0, 5.0)]
    assert best_scales(records) == {"moda": 10.0}  # mean validation 4.05 < 4.10; the test split favours 1.0


def test_upcycle_pretrains_continues_and_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(load_kjv_chapters()[:120]), encoding="utf-8")
    out = tmp_path / "upcycle"
    args = ["--models", "llama,denseformer:1x1,moda", "--seeds", "0", "1", "--new_param_lr_scale", "1", "10",
            "--layers", "2", "--pretrain_steps", "6", "--train_files", str(corpus),
            "--config", str(REPO / "configs" / "clm_tiny.json"), "--vocab_size", "300", "--block_size", "32",
            "--max_train_blocks", "48", "--max_eval_blocks", "8", "--eval_steps", "3", "--batch_size", "4",
            "--output_dir", str(out)]
    script = load_script("upcycle")
    table = script.main(args)
    pretrained = json.loads((out / "pretrain" / "pretrain.json").read_text())
    assert (out / "pretrain" / "final" / "model.safetensors").exists()
    runs = {(r["spec"], r["seed"], r["lr_scale"]): r
            for r in map(json.loads, (p.read_text() for p in (out / "runs").glob("*.json")))}
    upcycled = [(m, s, x) for m in ("denseformer:1x1", "moda") for s in (0, 1) for x in (1.0, 10.0)]
    assert sorted(runs) == sorted([("llama", s, 1.0) for s in (0, 1)] + upcycled)
    for run in runs.values():
        assert [p["step"] for p in run["curve"]] == [0, 3, 6]  # continued steps, from the upcycled model
        assert 0 < run["eval_loss"] < 7 and 0 < run["extra"]["test_loss"] < 7
        assert run["eval_loss"] == run["curve"][-1]["eval_loss"]
    start = pretrained["eval_loss"]  # the pre-trained Llama on the validation split
    tol = 64 * torch.finfo(torch.float32).eps * start
    for seed in (0, 1):
        assert runs["llama", seed, 1.0]["curve"][0]["eval_loss"] == pytest.approx(start, abs=tol)
        for scale in (1.0, 10.0):
            # the upcycled DenseFormer is the Llama (identity DWA) before any update
            assert runs["denseformer:1x1", seed, scale]["curve"][0]["eval_loss"] == pytest.approx(start, abs=tol)
            assert runs["denseformer:1x1", seed, scale]["new_parameters"] == ["model.dwa.alphas"]
        # continuing trains: the loss falls from the pre-trained model's
        assert runs["llama", seed, 1.0]["eval_loss"] < start
    # the scale matters (the new parameters move 10x faster), the seed sets the data order
    assert runs["denseformer:1x1", 0, 1.0]["eval_loss"] != runs["denseformer:1x1", 0, 10.0]["eval_loss"]
    assert runs["llama", 0, 1.0]["eval_loss"] != runs["llama", 1, 1.0]["eval_loss"]

    chosen = json.loads((out / "results.json").read_text())["chosen_lr_scale"]
    for spec in ("denseformer:1x1", "moda"):
        means = {x: (runs[spec, 0, x]["eval_loss"] + runs[spec, 1, x]["eval_loss"]) / 2 for x in (1.0, 10.0)}
        assert chosen[spec] == min(means, key=means.get)
        row = next(line for line in table.splitlines() if line.startswith(f"| {spec} | {chosen[spec]:g} ✓ |"))
        diffs = [runs[spec, s, chosen[spec]]["eval_loss"] - runs["llama", s, 1.0]["eval_loss"] for s in (0, 1)]
        assert f"| {sum(diffs) / 2:+.4f} [" in row and f"| {sum(d < 0 for d in diffs)}/2 |" in row
    assert (out / "continued_val_loss.png").stat().st_size > 5000
    assert not math.isnan(pretrained["train_seconds"])

    capsys.readouterr()
    assert script.main(args) == table  # a rerun trains nothing and reports the same
    log = capsys.readouterr().out
    assert "pre-trained Llama" in log and "(stored, skipped)" in log and log.count("stored, skipped") == 11


@pytest.mark.parametrize("kind", ["denseformer", "moda", "attnres"])
def test_new_parameters_default_to_those_a_same_shape_llama_lacks(kind):
    from depthfusion_hf.families import FAMILIES

    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=50))
    model = FAMILIES[kind].from_llama(llama)
    new = new_parameter_names(model)
    assert new == new_parameter_names(model, llama.state_dict()) and new
    assert sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in llama.parameters()) == sum(
        p.numel() for n, p in model.named_parameters() if n in new)


def test_an_unknown_new_parameter_name_is_refused(tmp_path):
    model = llama_to_denseformer(LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                                              num_hidden_layers=2, num_attention_heads=2,
                                                              num_key_value_heads=1, vocab_size=50)))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match=r"new_names not among the model's parameters: \['model.dwa.alpha'\]"):
        DepthFusionTrainer(model=model, args=args, new_names=["model.dwa.alpha"], new_param_lr_scale=2.0
                           ).create_optimizer()
    with pytest.raises(ValueError, match="new_param_lr_scale must be > 0; got 0"):
        DepthFusionTrainer(model=model, args=args, new_param_lr_scale=0)
