"""``scripts/push_to_hub.py``: dry run, upload with a token (mocked Hub), random init from a config."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, metadata_load

from depthfusion_hf.export import check_export_folder, save_remote_code_folder

from .builders import tiny_denseformer
from .test_export_folder import FakeHfApi

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "push_to_hub.py"


def _script():
    spec = importlib.util.spec_from_file_location("push_to_hub_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NoHub:
    def __init__(self, *args, **kwargs):
        raise AssertionError("the Hub must not be contacted")


@pytest.fixture
def trained(tmp_path):
    """A train_clm-style output: <out>/denseformer/final (remote-code folder + tokenizer) and <out>/results.json."""
    model, tokenizer = tiny_denseformer()
    out = tmp_path / "outputs" / "clm"
    save_remote_code_folder(model, out / "denseformer" / "final", tokenizer=tokenizer)
    results = {"args": {"dataset": "kjv"}, "settings": {"max_steps": 300},
               "runs": [{"name": "denseformer 2x2", "model_type": "denseformer", "eval_loss": 4.25,
                         "perplexity": 70.1054},
                        {"name": "llama (baseline)", "model_type": "llama", "eval_loss": 4.5,
                         "perplexity": 90.0171}]}
    (out / "results.json").write_text(json.dumps(results))
    return out, model


def test_dry_run_writes_folder_with_results_and_never_uploads(trained, tmp_path, monkeypatch):
    out, _ = trained
    monkeypatch.setattr("huggingface_hub.HfApi", NoHub)
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    target = tmp_path / "export"
    summary = _script().main([str(out / "denseformer" / "final"), "--repo-id", "me/denseformer-kjv",
                              "--output-dir", str(target), "--dry-run"])
    assert summary == {"folder": str(target.resolve()), "uploaded": False, "url": None, "results": True}
    assert check_export_folder(target, tokenizer=True, model_card=True) == []
    meta = metadata_load(target / "README.md")
    (result,) = meta["model-index"][0]["results"]
    assert meta["model-index"][0]["name"] == "denseformer-kjv"
    assert result["task"]["type"] == "text-generation" and result["dataset"]["type"] == "kjv"
    assert {m["type"]: m["value"] for m in result["metrics"]} == {"loss": 4.25, "perplexity": 70.1054}
    card = ModelCard((target / "README.md").read_text())
    assert [r.metric_value for r in card.data.eval_results] == [4.25, 70.1054]  # the Hub's own parser agrees
    assert "| King James Bible, held-out chapters | Validation perplexity | 70.1054 | 90.0171 |" in card.text


def test_token_uploads_the_written_folder(trained, tmp_path, monkeypatch):
    out, _ = trained
    FakeHfApi.instances.clear()
    monkeypatch.setattr("huggingface_hub.HfApi", FakeHfApi)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    target = tmp_path / "export"
    summary = _script().main([str(out / "denseformer" / "final"), "--repo-id", "me/denseformer-kjv",
                              "--output-dir", str(target), "--token", "hf_cli", "--private",
                              "--commit-message", "DenseFormer 2x2 on KJV"])
    assert summary["uploaded"] and summary["url"].endswith("/commit/abc123")
    (api,) = FakeHfApi.instances
    calls = {name: kwargs for name, _, kwargs in api.calls}
    assert calls["create_repo"]["private"] is True
    assert Path(calls["upload_folder"]["folder_path"]) == target.resolve()
    assert calls["upload_folder"]["repo_id"] == "me/denseformer-kjv"
    assert calls["upload_folder"]["commit_message"] == "DenseFormer 2x2 on KJV"


def test_no_token_writes_only(trained, tmp_path, monkeypatch):
    out, _ = trained
    monkeypatch.setattr("huggingface_hub.HfApi", NoHub)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    summary = _script().main([str(out / "denseformer" / "final"), "--repo-id", "me/x", "--output-dir",
                              str(tmp_path / "export"), "--results", "none"])
    assert not summary["uploaded"] and not summary["results"]
    assert "model-index" not in metadata_load(tmp_path / "export" / "README.md")


def test_random_init_from_config_claims_no_results(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.HfApi", NoHub)
    config = {"model_type": "moda", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "_comment": "tiny"}
    (tmp_path / "moda.json").write_text(json.dumps(config))
    summary = _script().main(["--config", str(tmp_path / "moda.json"), "--random-init", "--repo-id", "me/moda-init",
                              "--output-dir", str(tmp_path / "export"), "--dry-run"])
    assert not summary["results"]
    folder = Path(summary["folder"])
    assert check_export_folder(folder, model_card=True) == []
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 3
    meta = metadata_load(folder / "README.md")
    assert "model-index" not in meta and "datasets" not in meta  # an untrained model claims neither
    assert "No measured results" in (folder / "README.md").read_text()
    mask = os.umask(0o022)
    os.umask(mask)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~mask  # the usual mode, not the staging temp dir's 0700


@pytest.mark.parametrize("argv", [[], ["--config", "c.json"], ["folder", "--random-init"], ["folder", "--config", "c"]])
def test_bad_command_lines_are_rejected(argv):
    with pytest.raises(SystemExit):
        _script().parse_args(argv)
