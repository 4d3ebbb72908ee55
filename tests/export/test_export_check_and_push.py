"""``check_export_folder`` on broken files, and the upload path under the export rules (issue 19 §1, §7).

A broken ``config.json`` (or index, generation or tokenizer config) is a problem naming the file, never a
bare exception; an upload never sends the marker (at any depth), a symlink's outside content, or a folder
whose marker cannot be trusted; ``push_to_hub.py`` reports bad inputs and edited files without a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects

from depthfusion_hf.export import check_export_folder, push_folder_to_hub, save_remote_code_folder, validate_repo_id
from depthfusion_hf.safe_folder import MARKER, ExportTargetError

from .builders import tiny_denseformer
from .test_export_folder import FakeHfApi
from .test_push_script import SCRIPT

BROKEN_FILES = {
    "config.json not JSON": ("config.json", b'{"model_type": "moda",', "config.json is not valid JSON"),
    "config.json an array": ("config.json", b'["moda"]', "config.json must hold a JSON object; got list"),
    "config.json latin-1": ("config.json", b'{"model_type": "caf\xe9"}', "config.json is not valid UTF-8"),
    "config.json a folder": ("config.json", None, "config.json is a folder"),
    "config.json dangling": ("config.json", "->nowhere", "config.json is a symlink to nothing"),
    "config.json a pipe": ("config.json", "fifo", "config.json is not a regular file"),
    "model_type a list": ("config.json", b'{"model_type": ["moda"]}', "model_type must be one of"),
    "auto_map a list": ("config.json", b'{"model_type": "moda", "auto_map": ["x"]}', "auto_map must be an object"),
    "auto_map outside": ("config.json", b'{"model_type": "moda", "auto_map": {"AutoConfig": "../../evil.Config"}}',
                         "does not name a module file of the folder"),
    "index not JSON": ("model.safetensors.index.json", b"{", "model.safetensors.index.json is not valid JSON"),
    "index shard outside": ("model.safetensors.index.json", b'{"weight_map": {"w": "../../x.safetensors"}}',
                            "not a file name of the folder"),
    "index without map": ("model.safetensors.index.json", b'{"metadata": {}}', "'weight_map' must map"),
    "generation config broken": ("generation_config.json", b"{,}", "generation_config.json is not valid JSON"),
    "tokenizer config broken": ("tokenizer_config.json", b"[1]", "tokenizer_config.json must hold a JSON object"),
    "code latin-1": ("modeling_moda.py", b"# caf\xe9\n", "code file modeling_moda.py is not valid UTF-8"),
    "card latin-1": ("README.md", b"---\nlicense: caf\xe9\n---\n", "README.md is not valid UTF-8"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FILES))
def test_a_broken_file_is_a_problem_naming_it_never_an_exception(exported, tmp_path, case):
    name, data, message = BROKEN_FILES[case]
    copy = tmp_path / "copy"
    shutil.copytree(exported["moda"].folder, copy)
    path = copy / name
    path.unlink(missing_ok=True)  # the index is new: the tiny export has a single weights file
    if data is None:
        path.mkdir()
    elif data == "fifo":
        os.mkfifo(path)  # a read would block: the check must not open it
    elif isinstance(data, str):
        path.symlink_to(copy / data[2:])
    else:
        path.write_bytes(data)
    problems = check_export_folder(copy, tokenizer=True, model_card=True)
    assert any(message in problem for problem in problems), problems


def test_the_marker_is_never_uploaded_at_any_depth(exported, monkeypatch):
    FakeHfApi.instances.clear()
    monkeypatch.setattr("huggingface_hub.HfApi", FakeHfApi)
    push_folder_to_hub(exported["denseformer"].folder, "me/denseformer-tiny", token="t")
    (api,) = FakeHfApi.instances
    ignore = api.calls[1][2]["ignore_patterns"]
    paths = ["config.json", MARKER, f"sub/{MARKER}", f"a/b/{MARKER}", f"notes{MARKER}.txt"]
    assert list(filter_repo_objects(paths, ignore_patterns=ignore)) == ["config.json", f"notes{MARKER}.txt"]


def _copy_with(exported, tmp_path, change) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(exported["moda"].folder, copy)
    change(copy)
    return copy


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "credentials"
    secret.write_text("hf_secret_token")
    return secret


UNSAFE_FOLDERS = {
    "card links out": (lambda copy, tmp: (copy / "README.md").unlink() or (copy / "README.md").symlink_to(_secret(tmp)),
                       "README.md is a symlink to"),
    "extra link out": (lambda copy, tmp: (copy / "notes.txt").symlink_to(_secret(tmp)), "outside the folder"),
    "folder link out": (lambda copy, tmp: (copy / "extra").symlink_to(tmp), "extra is a symlink to"),
    "pipe": (lambda copy, tmp: os.mkfifo(copy / "pipe"), "pipe is not a regular file"),
}


@pytest.mark.parametrize("case", sorted(UNSAFE_FOLDERS))
def test_a_folder_whose_upload_would_leak_or_hang_is_refused_before_any_hub_call(exported, tmp_path, monkeypatch,
                                                                                 case):
    change, message = UNSAFE_FOLDERS[case]
    FakeHfApi.instances.clear()
    monkeypatch.setattr("huggingface_hub.HfApi", FakeHfApi)
    copy = _copy_with(exported, tmp_path, lambda c: change(c, tmp_path))
    with pytest.raises(ValueError, match=message):
        push_folder_to_hub(copy, "me/moda", token="t")
    assert FakeHfApi.instances == []


def test_a_link_inside_the_folder_may_be_uploaded(exported, tmp_path, monkeypatch):
    FakeHfApi.instances.clear()
    monkeypatch.setattr("huggingface_hub.HfApi", FakeHfApi)
    copy = _copy_with(exported, tmp_path, lambda c: (c / "vocab-link.json").symlink_to(c / "tokenizer.json"))
    push_folder_to_hub(copy, "me/moda", token="t")
    assert len(FakeHfApi.instances) == 1


def test_a_folder_with_an_untrusted_marker_is_not_uploaded(exported, tmp_path, monkeypatch):
    FakeHfApi.instances.clear()
    monkeypatch.setattr("huggingface_hub.HfApi", FakeHfApi)

    def forge(copy: Path) -> None:
        (copy / MARKER).write_text(json.dumps({"written_by": "depthfusion-hf", "format": 2,
                                                "files": ["../../victim.txt"]}))

    copy = _copy_with(exported, tmp_path, forge)
    with pytest.raises(ExportTargetError, match=r"'\.\./\.\./victim\.txt'"):
        push_folder_to_hub(copy, "me/moda", token="t")
    with pytest.raises(ValueError, match="not a folder"):
        push_folder_to_hub(tmp_path / "missing", "me/moda", token="t")
    assert FakeHfApi.instances == []


@pytest.mark.parametrize("repo_id", ["me/..", "me/.hidden", "me/a--b", "me/a..b", "me/name-", "me/" + "x" * 97])
def test_a_repo_id_the_hub_would_refuse_is_refused_first(repo_id):
    with pytest.raises(ValueError, match="repo_id"):
        validate_repo_id(repo_id)


SCRIPT_CASES = textwrap.dedent("""
    import contextlib, io, json, os, runpy, sys, warnings
    import huggingface_hub
    class NoHub:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the Hub must not be contacted")
    huggingface_hub.HfApi = NoHub
    script, cases = sys.argv[1], json.loads(sys.argv[2])
    for name, argv in cases.items():
        sys.argv, err = [script, *argv], io.StringIO()
        try:
            with contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
            err.write(str(exit.code))
        except BaseException as error:
            code = f"uncaught {type(error).__name__}: {error}"
        warned = [str(w.message) for w in caught]
        print(json.dumps({"case": name, "code": code, "stderr": err.getvalue(), "warnings": warned}))
""")


def test_the_script_reports_bad_inputs_and_edited_files_without_a_traceback(tmp_path):
    model, tokenizer = tiny_denseformer()
    good = save_remote_code_folder(model, tmp_path / "model", tokenizer=tokenizer)
    export = tmp_path / "export"
    (tmp_path / "broken.json").write_text('{"model_type": "moda",\n "hidden_size": }')
    (tmp_path / "results.json").write_text("{not json")
    (tmp_path / "folder.json").mkdir()
    edited_first = ["--output-dir", str(export), "--dry-run", "--results", "none"]
    cases = {
        "broken config": (["--config", str(tmp_path / "broken.json"), "--random-init"], 1,
                          "broken.json:2: not valid JSON"),
        "config folder": (["--config", str(tmp_path / "folder.json"), "--random-init"], 1, "is a folder"),
        "missing config": (["--config", str(tmp_path / "nope.json"), "--random-init"], 1, "not found"),
        "broken results": ([str(good), "--results", str(tmp_path / "results.json"), "--dry-run",
                            "--output-dir", str(tmp_path / "x")], 1, "results.json:1: not valid JSON"),
        "missing model": ([str(tmp_path / "no-model"), "--dry-run"], 1, "no-model"),
        "first export": ([str(good), *edited_first], 0, ""),
    }
    proc = _run_cases(cases, tmp_path)
    for name, (_, code, message) in cases.items():
        assert proc[name]["code"] == code and message in proc[name]["stderr"], proc[name]
    (export / "README.md").write_text("my own model card")
    cases = {"edited card": ([str(good), *edited_first], 1, "README.md"),
             "edited card, overwrite": ([str(good), *edited_first, "--overwrite"], 0, "")}
    proc = _run_cases(cases, tmp_path)
    assert proc["edited card"]["code"] == 1 and "changed since" in proc["edited card"]["stderr"]
    assert "--overwrite" in proc["edited card"]["stderr"]
    assert proc["edited card, overwrite"]["code"] == 0
    assert any("README.md" in w and "replaced" in w for w in proc["edited card, overwrite"]["warnings"])
    assert "my own model card" not in (export / "README.md").read_text()


def _run_cases(cases: dict, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    argv = {name: args for name, (args, _, _) in cases.items()}
    proc = subprocess.run([sys.executable, "-c", SCRIPT_CASES, str(SCRIPT), json.dumps(argv)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith('{"case"'):
            record = json.loads(line)
            out[record["case"]] = record
    return out

