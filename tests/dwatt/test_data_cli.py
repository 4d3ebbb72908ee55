"""The few-shot NER recipe's data and command-line checks (issue 19 §7): settings that cannot give a meaningful
experiment, data paths that are not files, and config files that are not JSON objects are refused at
construction, naming the setting or the file and line, before any model or data is loaded."""

from __future__ import annotations

import codecs
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from depthfusion_hf.recipes import ner

ROOT = Path(__file__).resolve().parents[2]

BAD_SETTINGS = [
    ({"sizes": []}, "sizes is empty"), ({"seeds": []}, "seeds is empty"), ({"fusions": []}, "fusions is empty"),
    ({"seeds": [1.5]}, "seeds must be integers"), ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"batch_size": -8}, "batch_size"), ({"max_length": 2}, "max_length must be an integer >= 3"),
    ({"max_length": 0}, "max_length"), ({"wnut_test_size": 0}, "wnut_test_size"),
    ({"max_test_sentences": -1}, "max_test_sentences must be an integer >= 0"), ({"num_threads": -1}, "num_threads"),
    ({"learning_rate": 0.0}, "learning_rate must be a finite number > 0"), ({"learning_rate": -1e-4}, "learning_rate"),
    ({"learning_rate": float("nan")}, "learning_rate"), ({"head_learning_rate": float("inf")}, "head_learning_rate"),
    ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0"), ({"warmup": -1.0}, "warmup"),
    ({"max_steps": 0, "epochs": 0.0}, "epochs must be a finite number > 0"), ({"max_steps": 2.5}, "max_steps"),
    ({"dataset": "conll2003", "train_file": "T", "test_file": "T"}, "not both"),
    ({"dataset_config": "en"}, "dataset_config needs dataset"),
    ({"dataset": "conll2003", "validation_file": "T"}, "validation_file needs train_file"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_SETTINGS, ids=[str(k) for k, _ in BAD_SETTINGS])
def test_settings_that_give_no_meaningful_experiment_are_refused(tmp_path, kwargs, message):
    train = tmp_path / "train.conll"
    train.write_text("Ann\tB-PER\n")
    kwargs = {key: str(train) if value == "T" else value for key, value in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        ner.NerSettings(**kwargs)


def test_epochs_are_checked_only_when_they_are_used():
    assert ner.NerSettings(max_steps=10, epochs=0.0).epochs == 0.0


@pytest.mark.parametrize("kind", ["folder", "missing", "dangling"])
@pytest.mark.parametrize("field", ["train_file", "test_file", "validation_file", "selected_settings"])
def test_a_data_path_that_is_not_a_file_is_named_for_what_it_is(tmp_path, kind, field):
    good = tmp_path / "good.conll"
    good.write_text("Ann\tB-PER\n")
    bad = tmp_path / "bad"
    if kind == "folder":
        bad.mkdir()
    elif kind == "dangling":
        bad.symlink_to(tmp_path / "nowhere")
    kwargs = {"train_file": str(good), "test_file": str(good), field: str(bad)}
    message = {"folder": "is a folder, not a file", "missing": "not found", "dangling": "symlink to nothing"}[kind]
    with pytest.raises(ValueError, match=message) as error:
        ner.NerSettings(**kwargs)
    assert field in str(error.value) and str(bad) in str(error.value)


@pytest.mark.parametrize(("data", "message"), [
    (b'{"max_steps": 10,\n "seeds": [1, 2,]\n}', r"cfg.json:2: not valid JSON"),
    (b"max_steps = 10\n", r"cfg.json:1: not valid JSON"),
    (b'["max_steps", 10]', "expected a JSON object of option values"),
    (b'{"max_steps": "caf\xe9"}', "not valid UTF-8"),
    (codecs.BOM_UTF16_LE + '{"a": 1}'.encode("utf-16-le"), "the file is UTF-16"),
], ids=["trailing-comma", "not-json", "array", "latin-1", "utf-16"])
def test_a_config_file_that_is_no_json_object_is_refused_naming_file_and_line(tmp_path, data, message):
    path = tmp_path / "cfg.json"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        ner.read_config(path)


def test_a_config_with_a_byte_order_mark_and_windows_line_ends_is_read(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_bytes(codecs.BOM_UTF8 + b'{\r\n  "max_steps": 12,\r\n  "_comment": "x"\r\n}\r\n')
    assert ner.read_config(path) == {"max_steps": 12}


@pytest.mark.parametrize("kind", ["folder", "missing"])
def test_a_config_path_that_is_not_a_file_is_named(tmp_path, kind):
    path = tmp_path / "cfg.json"
    if kind == "folder":
        path.mkdir()
    with pytest.raises(ValueError, match="config file .*(is a folder|not found)"):
        ner.read_config(path)


def test_selected_settings_of_the_wrong_shape_are_refused(tmp_path):
    path = tmp_path / "selected.json"
    path.write_text(json.dumps({"5-shot": ["dwatt"]}))
    with pytest.raises(ValueError, match="expected a JSON object"):
        ner.load_selected(ner.NerSettings(sizes=["5-shot"], fusions=["dwatt"], selected_settings=str(path)))


def test_the_script_turns_each_refusal_into_a_usage_error_before_any_work(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"max_steps": 10,}')
    folder = tmp_path / "train_folder"
    folder.mkdir()
    cases = {"broken config": (["--config", str(broken)], "broken.json:1: not valid JSON"),
             "config folder": (["--config", str(tmp_path)], "is a folder"),
             "train folder": (["--config", "", "--train_file", str(folder), "--test_file", str(folder)],
                              "train_file " + str(folder) + " is a folder"),
             "batch size": (["--config", "", "--batch_size", "0"], "batch_size must be an integer >= 1")}
    script = str(ROOT / "scripts" / "train_ner_fewshot.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    code = ("import contextlib, io, json, runpy, sys\n"
            "script, cases = sys.argv[1], json.loads(sys.argv[2])\n"
            "for name, argv in cases.items():\n"
            "    sys.argv, err = [script, *argv], io.StringIO()\n"
            "    try:\n"
            "        with contextlib.redirect_stderr(err):\n"
            "            runpy.run_path(script, run_name='__main__')\n"
            "        code = 0\n"
            "    except SystemExit as exit:\n"
            "        code = exit.code\n"
            "    print(json.dumps({'case': name, 'code': code, 'stderr': err.getvalue()}))\n")
    proc = subprocess.run([sys.executable, "-c", code, script, json.dumps({k: v for k, (v, _) in cases.items()})],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["case"]: r for r in map(json.loads, proc.stdout.splitlines()) if r.get("case")}
    for name, (_, message) in cases.items():
        assert results[name]["code"] == 2 and message in results[name]["stderr"], results[name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.json", "train_folder"]  # nothing was written
