"""scripts/train_ner_fewshot.py: argument handling, and a few real steps on the MiniLM encoder and WNUT-16."""

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest

from depthfusion_hf.data import ConllFormatError

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("train_ner_fewshot", ROOT / "scripts" / "train_ner_fewshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_file_sets_defaults_and_rejects_unknown_keys(tmp_path):
    script = load_script()
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"sizes": ["3-shot", "40"], "seeds": [4], "fusions": ["concat"]}))
    args = script.parse_args(["--config", str(good), "--seeds", "5", "6"])
    assert [s.label for s in args.sizes] == ["3-shot", "40"] and args.seeds == [5, 6] and args.fusions == ["concat"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"learning_rte": 1e-3}))
    with pytest.raises(SystemExit):
        script.parse_args(["--config", str(bad)])
    with pytest.raises(SystemExit):
        script.parse_args(["--train_file", str(good)])  # --test_file is required with it


def test_local_files_are_read_and_malformed_ones_name_file_and_line(tmp_path):
    script = load_script()
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("Ann\tB-PER\nsings\tO\n\nRome\tB-LOC\n")
    test.write_text("Bob\tB-PER\nin\tO\nOslo\tLOC\n")
    args = script.parse_args(["--train_file", str(train), "--test_file", str(test)])
    with pytest.raises(ConllFormatError, match=rf"{test}:3: invalid tag 'LOC'"):
        script.load_splits(args)
    test.write_text("Bob\tB-PER\nin\tO\n\nOslo\tB-LOC\n")
    splits, name = script.load_splits(args)
    assert name == "train.txt" and len(splits["train"]) == 2 and len(splits["test"]) == 2
    assert splits["validation"] == []


@pytest.mark.integration
def test_a_few_real_steps_write_sane_outputs(tmp_path):
    script = load_script()
    out = tmp_path / "out"
    payload = script.main(["--config", str(ROOT / "configs" / "ner_wnut16_fewshot.json"),
                           "--sizes", "8", "1-shot", "--seeds", "1", "2", "--fusions", "last", "dwatt",
                           "--max_steps", "2", "--max_test_sentences", "40", "--output_dir", str(out)])
    for name in ("runs.json", "runs.csv", "results.md", "f1_vs_size.png"):
        assert (out / name).is_file(), name
    assert (out / "f1_vs_size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "f1_vs_size.png").stat().st_size > 5000

    runs = json.loads((out / "runs.json").read_text())["runs"]
    assert runs == payload["runs"] and len(runs) == 8  # 2 sizes x 2 seeds x 2 fusions
    assert {(r["size"], r["seed"], r["fusion"]) for r in runs} == {
        (size, seed, fusion) for size in ("8", "1-shot") for seed in (1, 2) for fusion in ("last", "dwatt")}
    for run in runs:
        assert run["steps"] == 2
        assert 0.0 <= run["f1"] <= 100.0 and 0.0 <= run["precision"] <= 100.0 and 0.0 <= run["recall"] <= 100.0
        assert math.isfinite(run["train_loss"]) and run["train_loss"] > 0
        assert run["fusion_params"] == (1202472 if run["fusion"] == "dwatt" else 0)  # MiniLM: D=384, L=6
        if run["size"] == "8":
            assert run["train_sentences"] == 8
        else:
            assert run["train_entities"] >= 10  # at least one mention of each of the 10 WNUT types
    # the same seed samples the same training set for every fusion method
    for size in ("8", "1-shot"):
        for seed in (1, 2):
            pair = [r for r in runs if r["size"] == size and r["seed"] == seed]
            assert pair[0]["train_sentences"] == pair[1]["train_sentences"]
            assert pair[0]["train_entities"] == pair[1]["train_entities"]

    with (out / "runs.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 8 and float(rows[0]["f1"]) == runs[0]["f1"]

    summary = payload["summary"]
    cell = next(r for r in summary if r["size"] == "8" and r["fusion"] == "dwatt")
    f1s = [r["f1"] for r in runs if r["size"] == "8" and r["fusion"] == "dwatt"]
    assert cell["runs"] == 2 and cell["f1_mean"] == pytest.approx(sum(f1s) / 2)
    table = (out / "results.md").read_text()
    assert "| 8 |" in table and "| 1-shot |" in table and "±" in table and "over `last`" in table
