"""The fair few-shot NER study (depthfusion_hf.recipes.ner_study, scripts/ner_study.py): the last_ln control head,
the paired statistics, selection on dev only, resume, and a real run of a few steps on MiniLM and WNUT-16."""

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from depthfusion_hf.models.fusion_dwatt import DWAttLastLayerNorm
from depthfusion_hf.recipes import ner_study
from depthfusion_hf.recipes.ner_study import NerStudySettings, paired_gain, select_point

from .helpers import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_last_ln_is_a_layer_norm_of_the_last_state_only():
    model = tiny_model("last_ln", layers=3)
    assert type(model.fusion) is DWAttLastLayerNorm and model.fusion_num_parameters() == 2 * 32
    states = [torch.randn(2, 4, 32) * 0.3 for _ in range(4)]
    fused, weights = model.fusion(states, None)
    assert weights is None
    norm = model.fusion.norm
    torch.testing.assert_close(fused, F.layer_norm(states[-1], (32,), norm.weight, norm.bias, norm.eps))
    rms = fused.pow(2).mean(-1).sqrt()  # identity affine at init: unit RMS per token, whatever z_L's scale
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=0, atol=1e-3)
    changed = [s + 1.0 for s in states[:-1]] + [states[-1]]
    assert torch.equal(model.fusion(changed, None)[0], fused)  # z_0..z_{L-1} are not read


def test_paired_gain_is_the_t_interval_of_the_per_seed_differences():
    values, base = {1: 10.0, 2: 12.0, 3: 9.0, 9: 50.0}, {1: 8.0, 2: 12.0, 3: 4.0, 7: 0.0}
    gain = paired_gain(values, base)
    diffs = [2.0, 0.0, 5.0]  # seeds 1..3 only: 7 and 9 are unpaired
    mean, std = statistics.mean(diffs), statistics.stdev(diffs)
    half = 4.302652729911275 * std / math.sqrt(3)  # t_{0.975, 2}
    table = 1e-4 * std / math.sqrt(3)  # the t quantile comes from a 4-decimal table
    assert gain["n"] == 3 and gain["wins"] == 2 and gain["diffs"] == diffs  # a tie is not a win
    assert gain["mean"] == pytest.approx(mean, rel=1e-12) and gain["std"] == pytest.approx(std, rel=1e-12)
    assert gain["low"] == pytest.approx(mean - half, abs=table)
    assert gain["high"] == pytest.approx(mean + half, abs=table)
    one = paired_gain({1: 3.0}, {1: 1.0})
    assert one["mean"] == 2.0 and one["low"] is None and one["wins"] == 1
    assert paired_gain({1: 3.0}, {2: 1.0}) is None


def test_selection_takes_the_best_mean_dev_f1_and_breaks_ties_by_fewer_steps_then_lower_rate():
    def run(lr, steps, f1):
        return {"learning_rate": lr, "head_learning_rate": 10 * lr, "max_steps": steps, "dev_f1": f1}

    runs = [run(1e-4, 40, 10.0), run(1e-4, 40, 20.0), run(1e-3, 40, 16.0), run(1e-3, 40, 14.0),
            run(1e-4, 80, 30.0), run(1e-4, 80, 0.0), run(3e-4, 40, 15.0), run(3e-4, 40, 15.0)]
    point = select_point(runs)  # mean 15 at four points: 40 steps beat 80, then 1e-4 beats 3e-4 and 1e-3
    assert (point["learning_rate"], point["max_steps"], point["runs"]) == (1e-4, 40, 2)
    assert point["dev_f1_mean"] == 15.0 and point["dev_f1_std"] == pytest.approx(statistics.stdev([10.0, 20.0]))
    point = select_point(runs + [run(1e-3, 80, 15.5), run(1e-3, 80, 15.5)])
    assert (point["learning_rate"], point["max_steps"]) == (1e-3, 80)


def test_settings_reject_what_the_study_sets_itself_and_malformed_values():
    with pytest.raises(ValueError, match=r"the study sets \['learning_rate'\] itself"):
        NerStudySettings.from_values({"learning_rate": 1e-3})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['step_gird'\]"):
        NerStudySettings.from_values({"step_gird": [3]})
    with pytest.raises(ValueError, match="methods must be among"):
        NerStudySettings(methods=["mean"])
    with pytest.raises(ValueError, match="shard must be 'k/n'"):
        NerStudySettings(shard="2/2")
    with pytest.raises(ValueError, match="step_grid has a value twice"):
        NerStudySettings(step_grid=[40, 40])
    settings = NerStudySettings.from_values({"batch_size": 4, "seeds": [7], "_comment": "x"})
    assert settings.base.batch_size == 4 and settings.seeds == [7]
    selected = ner_study.cells(NerStudySettings(sizes=["5-shot", "50"], methods=["last", "dwatt"], shard="1/3"))
    assert [(size.label, method) for size, method in selected] == [("5-shot", "dwatt")]


def test_the_script_turns_settings_errors_into_usage_errors(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("ner_study_script", ROOT / "scripts" / "ner_study.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    config = tmp_path / "study.json"
    config.write_text(json.dumps({"max_steps": 40}))
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(["--config", str(config)])
    assert exit_info.value.code == 2 and "the study sets ['max_steps'] itself" in capsys.readouterr().err
    settings, report_only = script.parse_args(["--config", str(ROOT / "configs" / "ner_study_wnut16.json"),
                                               "--seeds", "3", "--report_only"])
    assert settings.seeds == [3] and report_only and settings.step_grid == [40, 120]
    assert [s.label for s in settings.sizes] == ["5-shot", "10-shot", "50", "200"]
    assert settings.methods == ["last", "last_ln", "concat", "deeper", "dwatt"]


def tiny_study(out: Path, **overrides) -> NerStudySettings:
    """One size, two methods, two test seeds, a 2-point grid of one step: 8 runs of MiniLM on WNUT-16."""
    values = {"sizes": ["8"], "methods": ["last", "last_ln"], "seeds": [1, 2], "selection_seeds": [5],
              "learning_rates": [1e-4, 1e-3], "step_grid": [1], "dev_size": 12, "max_test_sentences": 16,
              "max_length": 48, "output_dir": str(out)}
    return NerStudySettings.from_values(values | overrides)


@pytest.mark.integration
def test_a_real_tiny_study_selects_on_dev_reports_paired_gains_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "study"
    settings = tiny_study(out)
    trained = []
    real_run_one = ner_study.run_one

    def counting_run_one(run_settings, encoder, tokenizer, train, fusion, seed, label_list, evaluation, workdir):
        trained.append((fusion, seed, run_settings.learning_rate, run_settings.max_steps, sorted(evaluation)))
        return real_run_one(run_settings, encoder, tokenizer, train, fusion, seed, label_list, evaluation, workdir)

    monkeypatch.setattr(ner_study, "run_one", counting_run_one)
    summary = ner_study.run_study(settings)
    assert len(trained) == 8  # 2 methods x (2 grid points x 1 selection seed + 2 test seeds)

    records = ner_study.study_store(settings).records()
    selection = [r for r in records if r["phase"] == "select"]
    tests = [r for r in records if r["phase"] == "test"]
    assert len(selection) == 4 and len(tests) == 4
    # selection runs are scored on dev only, test runs on test only
    assert all("dev_f1" in r and "f1" not in r for r in selection)
    assert all("f1" in r and "dev_f1" not in r for r in tests)
    assert sorted(e for *_, e in trained) == [["dev"]] * 4 + [["test"]] * 4

    # no sentence is shared between the training sets, dev and test
    data = ner_study.prepare_data(settings)
    test_tokens = {tuple(s["tokens"]) for s in data.test}
    dev_tokens = {tuple(s["tokens"]) for s in data.dev}
    assert len(data.dev) == 12 and len(data.test) == 16 and data.dropped > 0
    assert not test_tokens & dev_tokens
    assert not test_tokens & {tuple(s["tokens"]) for s in data.pool}
    for record in records:
        train_tokens = {tuple(data.pool[i]["tokens"]) for i in record["train_indices"]}
        assert len(record["train_indices"]) == record["train_sentences"] == 8
        assert not train_tokens & (test_tokens | dev_tokens)

    # the selected point is the dev argmax of the stored selection runs, and the test runs use it
    selected = json.loads((out / "selected.json").read_text())
    assert selected == summary["selected"]
    for method in ("last", "last_ln"):
        mine = {r["learning_rate"]: r["dev_f1"] for r in selection if r["method"] == method}
        best = min(mine, key=lambda lr: (-mine[lr], lr))
        assert selected["8"][method]["learning_rate"] == best and selected["8"][method]["max_steps"] == 1
        assert selected["8"][method]["dev_f1_mean"] == mine[best]
        assert {(r["learning_rate"], r["head_learning_rate"], r["steps"]) for r in tests if r["method"] == method} == {
            (best, float(f"{10 * best:.12g}"), 1)}

    # the paired gains in results.json and results.md are those of the stored F1s
    f1 = {(r["method"], r["seed"]): r["f1"] for r in tests}
    results = json.loads((out / "results.json").read_text())
    row = next(r for r in results["summary"] if r["fusion"] == "last_ln")
    diffs = [f1[("last_ln", s)] - f1[("last", s)] for s in (1, 2)]
    gain = row["gain_over_last"]
    assert gain["diffs"] == pytest.approx(diffs, abs=1e-9) and gain["n"] == 2
    assert gain["mean"] == pytest.approx(statistics.mean(diffs), abs=1e-9)
    assert gain["wins"] == sum(d > 0 for d in diffs)
    assert row["f1_mean"] == pytest.approx(statistics.mean([f1[("last_ln", 1)], f1[("last_ln", 2)]]), abs=1e-9)
    back = next(r for r in results["summary"] if r["fusion"] == "last")["gain_over_last_ln"]
    assert back["mean"] == pytest.approx(-gain["mean"], abs=1e-9)
    table = (out / "results.md").read_text()
    assert f"{gain['mean']:+.2f} [{gain['low']:+.2f}, {gain['high']:+.2f}] ({gain['wins']}/2)" in table
    assert f"{row['f1_mean']:.2f} ± {row['f1_std']:.2f} (2)" in table
    assert (out / "f1_vs_size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # resume: nothing finished is trained again; a missing run is trained alone
    trained.clear()
    ner_study.run_study(settings)
    assert trained == []
    missing = ner_study.study_store(settings).path(ner_study.run_key("test", "8", "last_ln", "seed2"))
    missing.unlink()
    ner_study.run_study(settings)
    assert [(fusion, seed) for fusion, seed, *_ in trained] == [("last_ln", 2)] and missing.is_file()

    # a folder written with other fixed settings is refused before any training
    trained.clear()
    with pytest.raises(ValueError, match=r"other settings \(differing: \['dev_size'\]\)"):
        ner_study.run_study(tiny_study(out, dev_size=13))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "results.md").write_text("someone else's")
    (foreign / "notes.txt").write_text("kept")  # files of other names are not in the way
    with pytest.raises(ValueError, match=r"holds \['results.md'\] but no run of a study"):
        ner_study.run_study(tiny_study(foreign))
    assert trained == [] and (foreign / "results.md").read_text() == "someone else's"
