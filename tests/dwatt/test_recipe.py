"""The few-shot NER recipe (depthfusion_hf.recipes.ner) and its front end scripts/train_ner_fewshot.py: settings and
config files, data loading, and a few real steps on the MiniLM encoder and WNUT-16."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from depthfusion_hf.data import ConllFormatError
from depthfusion_hf.recipes import ner

ROOT = Path(__file__).resolve().parents[2]


def test_config_file_sets_defaults_and_rejects_unknown_keys(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"sizes": ["3-shot", "40"], "seeds": [4], "fusions": ["concat"], "_comment": "x"}))
    settings = ner.NerSettings.from_config(good, seeds=[5, 6])
    assert [s.label for s in settings.sizes] == ["3-shot", "40"] and settings.seeds == [5, 6]
    assert settings.fusions == ["concat"] and settings.config == str(good)
    assert settings.max_steps == ner.NerSettings().max_steps  # keys the file does not set keep their defaults
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"learning_rte": 1e-3}))
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['learning_rte'\]"):
        ner.NerSettings.from_config(bad)
    with pytest.raises(ValueError, match="train_file and test_file go together"):
        ner.NerSettings(train_file=str(good))
    with pytest.raises(ValueError, match="fusions must be among"):
        ner.NerSettings(fusions=["mean"])
    with pytest.raises(ValueError, match="training size must be"):
        ner.NerSettings(sizes=["0-shot"])


def test_script_command_line_takes_config_defaults_and_reports_errors(tmp_path):
    """The front end turns the recipe's errors into usage errors (exit 2) before any work."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"learning_rte": 1e-3}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    script = str(ROOT / "scripts" / "train_ner_fewshot.py")
    for argv, message in ((["--config", str(bad)], "unknown option(s) ['learning_rte']"),
                          (["--train_file", str(bad)], "train_file and test_file go together")):
        proc = subprocess.run([sys.executable, script, *argv, "--output_dir", str(tmp_path / "out")], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_local_files_are_read_and_malformed_ones_name_file_and_line(tmp_path):
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("Ann\tB-PER\nsings\tO\n\nRome\tB-LOC\n")
    test.write_text("Bob\tB-PER\nin\tO\nOslo\tLOC\n")
    settings = ner.NerSettings(train_file=str(train), test_file=str(test))
    with pytest.raises(ConllFormatError, match=rf"{test}:3: invalid tag 'LOC'"):
        ner.load_splits(settings)
    test.write_text("Bob\tB-PER\nin\tO\n\nOslo\tB-LOC\n")
    splits, name = ner.load_splits(settings)
    assert name == "train.txt" and len(splits["train"]) == 2 and len(splits["test"]) == 2
    assert splits["validation"] == []


def test_pool_copies_of_test_sentences_are_dropped(tmp_path):
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("Ann\tB-PER\nsings\tO\n\nRome\tB-LOC\n\nBob\tB-PER\nin\tO\n")
    test.write_text("Bob\tB-PER\nin\tO\n\nOslo\tB-LOC\n")
    splits, name = ner.load_splits(ner.NerSettings(train_file=str(train), test_file=str(test)))
    assert [s["tokens"] for s in splits["train"]] == [["Ann", "sings"], ["Rome"]]
    assert name == "train.txt; 1 train sentences equal to test sentences dropped"
    kept, _ = ner.load_splits(ner.NerSettings(train_file=str(train), test_file=str(test), drop_test_duplicates=False))
    assert len(kept["train"]) == 3


def test_the_default_wnut_pool_holds_no_test_sentence():
    splits, name = ner.load_splits(ner.NerSettings())
    test = {tuple(s["tokens"]) for s in splits["test"]}
    assert not any(tuple(s["tokens"]) in test for s in splits["train"])
    assert "29 train sentences equal to test sentences dropped" in name


@pytest.mark.integration
def test_a_few_real_steps_write_sane_outputs(tmp_path):
    out = tmp_path / "out"
    settings = ner.NerSettings.from_config(ROOT / "configs" / "ner_wnut16_fewshot.json", sizes=["8", "1-shot"],
                                           seeds=[1, 2], fusions=["last", "dwatt"], max_steps=2,
                                           max_test_sentences=40, output_dir=str(out), selected_settings=None)
    payload = ner.run_experiment(settings)
    for name in ("runs.json", "runs.csv", "results.md", "f1_vs_size.png"):
        assert (out / name).is_file(), name
    assert (out / "f1_vs_size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "f1_vs_size.png").stat().st_size > 5000

    written = json.loads((out / "runs.json").read_text())
    runs = written["runs"]
    assert written["settings"]["sizes"] == ["8", "1-shot"] and written["settings"]["max_steps"] == 2
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


def test_selected_settings_of_a_study_replace_the_rates_and_steps_of_their_cell_only(tmp_path):
    path = tmp_path / "selected.json"
    point = {"learning_rate": 1e-3, "head_learning_rate": 1e-2, "max_steps": 120, "dev_f1_mean": 20.0}
    path.write_text(json.dumps({"5-shot": {"dwatt": point, "last": point | {"learning_rate": 1e-4}}}))
    settings = ner.NerSettings(sizes=["5-shot"], fusions=["last", "dwatt"], selected_settings=str(path))
    selected = ner.load_selected(settings)
    size = settings.sizes[0]
    cell = ner.cell_settings(settings, selected, size, "dwatt")
    assert (cell.learning_rate, cell.head_learning_rate, cell.max_steps) == (1e-3, 1e-2, 120)
    assert ner.cell_settings(settings, selected, size, "last").learning_rate == 1e-4
    assert (cell.batch_size, cell.seeds) == (settings.batch_size, settings.seeds)  # nothing else changes
    assert settings.learning_rate == ner.NerSettings().learning_rate  # the settings object is not mutated
    unselected = ner.cell_settings(settings, {}, size, "dwatt")
    assert unselected is settings
    missing = ner.NerSettings(sizes=["5-shot", "50"], fusions=["dwatt"], selected_settings=str(path))
    with pytest.raises(ValueError, match=r"no selected settings for \(size, fusion\) \[\('50', 'dwatt'\)\]"):
        ner.load_selected(missing)
    assert ner.load_selected(ner.NerSettings()) == {}


def test_a_config_finds_its_selected_settings_beside_it_from_any_working_directory(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    point = {"learning_rate": 1e-3, "head_learning_rate": 1e-2, "max_steps": 120, "dev_f1_mean": 20.0}
    (folder / "selected.json").write_text(json.dumps({"5-shot": {"dwatt": point}}))
    (folder / "ner.json").write_text(json.dumps({"sizes": ["5-shot"], "fusions": ["dwatt"],
                                                 "selected_settings": "selected.json"}))
    monkeypatch.chdir(tmp_path)  # not the config's folder
    settings = ner.NerSettings.from_config(folder / "ner.json")
    assert settings.selected_settings == str(folder / "selected.json")
    assert ner.load_selected(settings)["5-shot"]["dwatt"]["max_steps"] == 120
    absolute = tmp_path / "elsewhere.json"
    (folder / "abs.json").write_text(json.dumps({"selected_settings": str(absolute)}))
    assert ner.read_config(folder / "abs.json")["selected_settings"] == str(absolute)


def test_the_script_defaults_to_the_settings_the_study_selected(tmp_path, monkeypatch):
    from tests.recipes.test_compare_families import load_script

    script = load_script("train_ner_fewshot")
    monkeypatch.chdir(tmp_path)  # any working directory
    settings = script.parse_args([])
    assert settings.selected_settings == str(ROOT / "configs" / "ner_wnut16_selected.json")
    selected = json.loads((ROOT / "configs" / "ner_wnut16_selected.json").read_text())
    loaded = ner.load_selected(settings)
    for size in settings.sizes:
        for fusion in settings.fusions:
            cell = ner.cell_settings(settings, loaded, size, fusion)
            point = selected[size.label][fusion]
            assert (cell.learning_rate, cell.head_learning_rate, cell.max_steps) == (
                point["learning_rate"], point["head_learning_rate"], point["max_steps"])
    plain = script.parse_args(["--selected_settings", ""])
    assert ner.load_selected(plain) == {} and plain.max_steps == ner.NerSettings().max_steps
