"""``scripts/push_to_hub.py``: dry run, upload with a token (mocked Hub), random init from a config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, metadata_load

from depthfusion_hf.export import check_export_folder, save_remote_code_folder
from depthfusion_hf.recipes.records import data_record

from .builders import tiny_denseformer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "push_to_hub.py"
# Runs the script as ``python scripts/push_to_hub.py ARGS`` would, with the Hub client replaced: "none" fails on
# any use, "fake" records the calls (as JSON lines in $FAKE_HUB_LOG) and answers like the Hub.
RUNNER = textwrap.dedent("""
    import json, os, runpy, sys
    import huggingface_hub

    class NoHub:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the Hub must not be contacted")

    class FakeHub:
        def __init__(self, token=None, **kwargs):
            self.token = token
        def _log(self, name, args, kwargs):
            with open(os.environ["FAKE_HUB_LOG"], "a") as log:
                log.write(json.dumps({"call": name, "args": list(args), "kwargs": kwargs, "token": self.token}) + "\\n")
        def create_repo(self, *args, **kwargs):
            self._log("create_repo", args, kwargs)
        def upload_folder(self, **kwargs):
            assert os.path.isfile(os.path.join(kwargs["folder_path"], "config.json"))
            self._log("upload_folder", (), kwargs)
            class Info:
                commit_url = f"https://huggingface.co/{kwargs['repo_id']}/commit/abc123"
            return Info()

    huggingface_hub.HfApi = FakeHub if os.environ["HUB"] == "fake" else NoHub
    sys.argv = [sys.argv[1]] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def run_script(args: list[str], tmp_path: Path, hub: str = "none", token: str | None = None):
    """The script in a new interpreter (offline); returns the finished process."""
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), HUB=hub, FAKE_HUB_LOG=str(tmp_path / "hub.log"))
    if token is not None:
        env["HF_TOKEN"] = token
    return subprocess.run([sys.executable, "-c", RUNNER, str(SCRIPT), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def hub_calls(tmp_path: Path) -> list[dict]:
    log = tmp_path / "hub.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def trained(tmp_path):
    """A train_clm-style output: <out>/denseformer/final (remote-code folder + tokenizer) and <out>/results.json."""
    model, tokenizer = tiny_denseformer()
    out = tmp_path / "outputs" / "clm"
    save_remote_code_folder(model, out / "denseformer" / "final", tokenizer=tokenizer)
    results = {"args": {"dataset": "kjv"}, "settings": {"max_steps": 300}, "data": data_record("kjv"),
               "runs": [{"name": "denseformer 2x2", "model_type": "denseformer", "eval_loss": 4.25,
                         "perplexity": 70.1054},
                        {"name": "llama (baseline)", "model_type": "llama", "eval_loss": 4.5,
                         "perplexity": 90.0171}]}
    (out / "results.json").write_text(json.dumps(results))
    return out, model


def test_dry_run_writes_folder_with_results_and_never_uploads(trained, tmp_path):
    out, _ = trained
    target = tmp_path / "export"
    proc = run_script([str(out / "denseformer" / "final"), "--repo-id", "me/denseformer-kjv",
                       "--output-dir", str(target), "--dry-run"], tmp_path, token="hf_from_env")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"results: using {out.resolve() / 'results.json'}" in proc.stdout
    assert f"wrote {target.resolve()}: " in proc.stdout and "dry run: nothing uploaded" in proc.stdout
    assert hub_calls(tmp_path) == []
    assert check_export_folder(target, tokenizer=True, model_card=True) == []
    meta = metadata_load(target / "README.md")
    (result,) = meta["model-index"][0]["results"]
    assert meta["model-index"][0]["name"] == "denseformer-kjv"
    assert result["task"]["type"] == "text-generation" and result["dataset"]["type"] == "kjv"
    assert {m["type"]: m["value"] for m in result["metrics"]} == {"loss": 4.25, "perplexity": 70.1054}
    card = ModelCard((target / "README.md").read_text())
    assert [r.metric_value for r in card.data.eval_results] == [4.25, 70.1054]  # the Hub's own parser agrees
    assert "| King James Bible, held-out chapters | Validation perplexity | 70.1054 | 90.0171 |" in card.text


def test_token_uploads_the_written_folder(trained, tmp_path):
    out, _ = trained
    target = tmp_path / "export"
    proc = run_script([str(out / "denseformer" / "final"), "--repo-id", "me/denseformer-kjv",
                       "--output-dir", str(target), "--token", "hf_cli", "--private",
                       "--commit-message", "DenseFormer 2x2 on KJV"], tmp_path, hub="fake")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "uploaded to https://huggingface.co/me/denseformer-kjv (https://huggingface.co/me/denseformer-kjv/" \
           "commit/abc123)" in proc.stdout
    calls = {call["call"]: call for call in hub_calls(tmp_path)}
    assert calls["create_repo"]["token"] == "hf_cli" and calls["create_repo"]["kwargs"]["private"] is True
    upload = calls["upload_folder"]["kwargs"]
    assert Path(upload["folder_path"]) == target.resolve()
    assert upload["repo_id"] == "me/denseformer-kjv"
    assert upload["commit_message"] == "DenseFormer 2x2 on KJV"
    assert upload["ignore_patterns"] == [".depthfusion-export.json", "*/.depthfusion-export.json"]  # never the marker


def test_no_token_writes_only(trained, tmp_path):
    out, _ = trained
    proc = run_script([str(out / "denseformer" / "final"), "--repo-id", "me/x", "--output-dir",
                       str(tmp_path / "export"), "--results", "none"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no token (--token or $HF_TOKEN): nothing uploaded" in proc.stdout and "results: using" not in proc.stdout
    assert "model-index" not in metadata_load(tmp_path / "export" / "README.md")


def test_token_without_repo_id_is_refused_before_writing(trained, tmp_path):
    out, _ = trained
    proc = run_script([str(out / "denseformer" / "final"), "--output-dir", str(tmp_path / "export")], tmp_path,
                      token="hf_x")
    assert proc.returncode == 1 and "uploading needs --repo-id" in proc.stderr
    assert not (tmp_path / "export").exists() and hub_calls(tmp_path) == []


def test_random_init_from_config_claims_no_results(tmp_path):
    config = {"model_type": "moda", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "_comment": "tiny"}
    (tmp_path / "moda.json").write_text(json.dumps(config))
    folder = tmp_path / "export"
    proc = run_script(["--config", str(tmp_path / "moda.json"), "--random-init", "--repo-id", "me/moda-init",
                       "--output-dir", str(folder), "--dry-run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert check_export_folder(folder, model_card=True) == []
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 3
    meta = metadata_load(folder / "README.md")
    assert "model-index" not in meta and "datasets" not in meta  # an untrained model claims neither
    assert "No measured results" in (folder / "README.md").read_text()
    mask = os.umask(0o022)
    os.umask(mask)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~mask  # the usual mode, not the staging temp dir's 0700


BAD_COMMAND_LINES = {
    "no source": ([], "give either a model folder or --config"),
    "config without --random-init": (["--config", "c.json"], "add --random-init"),
    "folder with --random-init": (["folder", "--random-init"], "--random-init goes with --config"),
    "two sources": (["folder", "--config", "c"], "give either a model folder or --config"),
    "bad repo id": (["folder", "--repo-id", "a/b/c"], "repo_id must look like 'user/name'"),
}
PARSE_ONLY = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    script, cases = sys.argv[1], json.loads(sys.argv[2])
    for name, argv in cases.items():
        sys.argv, err = [script, *argv], io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit:
            code = exit.code
        print(json.dumps({"case": name, "code": code, "stderr": err.getvalue()}))
""")


def test_bad_command_lines_are_rejected(tmp_path):
    """Every case in one interpreter (each a fresh run of the script as ``__main__``): usage errors, exit 2."""
    cases = {name: argv for name, (argv, _) in BAD_COMMAND_LINES.items()}
    proc = subprocess.run([sys.executable, "-c", PARSE_ONLY, str(SCRIPT), json.dumps(cases)], cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(results) == set(BAD_COMMAND_LINES)
    for name, (_, message) in BAD_COMMAND_LINES.items():
        assert results[name]["code"] == 2 and message in results[name]["stderr"], results[name]
    assert list(tmp_path.iterdir()) == []  # nothing was written
