"""``benchmarks/bench_models.py`` at a toy size: model names, the same-function check (passes on the same function,
fails on another, says when parameters differ), ``--before`` for every family, and the record it writes. No timing
thresholds: the numbers are checked for their structure and their arithmetic, not their size."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
TOY = ["--layers", "4", "--hidden", "64", "--intermediate", "96", "--vocab", "128", "--seq", "16", "--batch", "2",
       "--reps", "2", "--decode-reps", "2", "--prompt", "4", "--new-tokens", "3"]


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` (the benchmarks are scripts, not a package; they import ``harness``)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_model_names_follow_the_study_specs():
    zoo = load_benchmark("model_zoo")
    assert zoo.parse_name("attnres-block8-before") == zoo.ModelName("attnres-block8", False, True)
    assert zoo.parse_name("moda-before-noffn").text == "moda-noffn-before"  # the old names still work
    assert zoo.parse_name("moda-before-ckpt").text == "moda-ckpt-before"
    assert zoo.parse_name("moda-w4").spec == "moda:moda_depth_window=4"
    with pytest.raises(ValueError, match="the same in both checkouts"):
        zoo.parse_name("llama-before")
    with pytest.raises(ValueError, match="unknown model"):
        zoo.parse_name("gpt2")
    common = zoo.common_fields(12, 64, 96, 128, 16, None)
    block8 = zoo.builder(zoo.parse_name("attnres-block8"), common, {})()
    assert (block8.config.attnres_block_size, block8.config.num_blocks) == (3, 8)  # 8 blocks, as in the study
    with pytest.raises(ValueError, match="do not form 8 equal blocks"):
        zoo.builder(zoo.parse_name("attnres-block8"), zoo.common_fields(6, 64, 96, 128, 16, None), {})
    assert zoo.same_function_pairs(["llama", "llama-ckpt", "moda", "moda-before", "moda-ckpt-before"]) == [
        ("llama-ckpt", "llama"), ("moda", "moda-before"), ("moda-ckpt-before", "moda-before")]


def test_same_function_check_passes_fails_and_says_when_parameters_differ():
    bench = load_benchmark("bench_models")
    fields = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=1, vocab_size=128)
    builders = {"a": lambda: LlamaForCausalLM(LlamaConfig(**fields)),
                "same": lambda: LlamaForCausalLM(LlamaConfig(**fields)),
                "other": lambda: LlamaForCausalLM(LlamaConfig(**fields, rms_norm_eps=1e-2)),  # same parameters
                "wider": lambda: LlamaForCausalLM(LlamaConfig(**dict(fields, intermediate_size=128)))}
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    gates = bench.check_same_function(builders, [("a", "same"), ("a", "wider")], batch, torch.device("cpu"))
    assert gates["a|same"]["compared"] and gates["a|same"]["loss_rel"] == 0.0
    assert gates["a|wider"] == {"compared": False, "reason": gates["a|wider"]["reason"]}
    assert "size mismatch" in gates["a|wider"]["reason"]
    with pytest.raises(AssertionError, match="a vs other: loss differs"):
        bench.check_same_function(builders, [("a", "other")], batch, torch.device("cpu"))


def fake_checkout(tmp_path: Path) -> Path:
    """Another checkout: this one's models folder, copied (the same functions, imported under new names)."""
    checkout = tmp_path / "before"
    shutil.copytree(REPO / "src" / "depthfusion_hf" / "models", checkout / "src" / "depthfusion_hf" / "models",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return checkout


def test_bench_models_before_every_family_and_its_record(tmp_path, capsys):
    bench = load_benchmark("bench_models")
    out = tmp_path / "models.jsonl"
    models = ("llama,llama-control,denseformer-1x1,denseformer-1x1-before,attnres-block8,attnres-block8-before,"
              "moda,moda-before,moda-ckpt")
    record = bench.main([*TOY, "--models", models, "--before", str(fake_checkout(tmp_path)), "--out", str(out),
                         "--label", "toy"])
    printed = capsys.readouterr().out
    assert "load" in printed and "new ÷ before" in printed
    lines = out.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["label"] == "toy"
    stored = json.loads(lines[0])
    for key in ("date", "machine", "load", "torch", "commit", "command", "targets", "gates", "results"):
        assert key in stored, key
    assert stored["targets"]["attnres-block8"]["train"] == 1.12 and stored["targets"]["moda"]["peak"] == 1.25
    assert sorted(record["gates"]) == ["attnres-block8|attnres-block8-before", "denseformer-1x1|denseformer-1x1-before",
                                       "moda-ckpt|moda", "moda|moda-before"]
    for gate in record["gates"].values():  # the same code under two names: the same function
        assert gate["compared"] and gate["loss_rel"] <= gate["gate"] and gate["grad_rel_worst"] <= gate["gate"]
    results = {r["model"]: r for r in record["results"]}
    assert list(results) == models.split(",")
    llama = results["llama"]
    assert llama["train_ratio_paired_all"] == [1.0, 1.0] and llama["peak_ratio"] == 1.0
    for name, r in results.items():
        assert len(r["train_s_all"]) == 2 and len(r["decode_all"]) == 2
        pairs = [a / b for a, b in zip(r["train_s_all"], llama["train_s_all"])]
        assert r["train_ratio_paired_all"] == pytest.approx(pairs, rel=1e-12)
        assert r["ratios"]["train"]["median"] == pytest.approx(sorted(pairs)[0] / 2 + sorted(pairs)[1] / 2, rel=1e-12)
        assert ("vs_before" in r) == (f"{name}-before" in results), name
    new_old = [a / b for a, b in zip(results["moda"]["train_s_all"], results["moda-before"]["train_s_all"])]
    assert results["moda"]["vs_before"]["train"]["values"] == pytest.approx(new_old, rel=1e-12)
    verdicts = {(v["kind"], v["metric"]) for v in results["moda"]["verdicts"]}
    assert verdicts == {("target", "train"), ("target", "peak"), ("target", "decode")}
    dense = {(v["kind"], v["metric"]) for v in results["denseformer-1x1"]["verdicts"]}
    assert dense == {("context", "train"), ("context", "decode"), ("unchanged", "train"), ("unchanged", "decode")}


@pytest.mark.integration
def test_compiled_static_cache_decode_is_reported_for_every_model(tmp_path):
    """``--decode-compile``: Llama compiles whole and its compiled tokens equal the eager ones; a family either does
    the same or is reported with the reason it could not be compiled (never a silent eager number)."""
    bench = load_benchmark("bench_models")
    toy = [*TOY]
    toy[toy.index("--layers") + 1] = "2"
    record = bench.main([*toy, "--models", "llama,denseformer-1x1", "--decode-compile", "--out",
                         str(tmp_path / "m.jsonl")])
    assert record["compile"] == {"mode": "default", "fullgraph": True}
    results = {r["model"]: r for r in record["results"]}
    llama = results["llama"]["decode_compile"]
    assert "failed" not in llama and llama["tokens_equal_eager"] and llama["compile_s"] > 0
    assert len(llama["compiled_tok_s"]) == 2 and len(llama["static_tok_s"]) == 2
    dense = results["denseformer-1x1"]
    if "failed" in dense["decode_compile"]:
        assert dense["decode_compile"]["failed"]
        [verdict] = [v for v in dense["verdicts"] if v["metric"] == "decode_compiled"]
        assert verdict["value"] is None and not verdict["met"]  # a target that could not be measured is a miss
    else:
        assert dense["decode_compile"]["tokens_equal_eager"]
        assert "decode_compiled" in dense["ratios"]
