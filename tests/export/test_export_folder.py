"""Hub-ready export folders: completeness, the completeness check itself, atomicity, and the upload."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, metadata_load
from transformers import GenerationConfig

from depthfusion_hf.export import (
    check_export_folder,
    export_model,
    push_folder_to_hub,
    save_remote_code_folder,
)
from depthfusion_hf.families import FAMILIES
from depthfusion_hf.safe_folder import MARKER, load_marker

from .builders import tiny_denseformer


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("family", ["denseformer", "moda", "dwatt"])
def test_export_folder_is_complete(exported, family):
    item = exported[family]
    folder = item.folder
    assert check_export_folder(folder, tokenizer=True, model_card=True) == []
    config = json.loads((folder / "config.json").read_text())
    auto_map = config["auto_map"]
    task = "AutoModelForTokenClassification" if family == "dwatt" else "AutoModelForCausalLM"
    assert auto_map[task].startswith(f"modeling_{family}.")
    assert auto_map["AutoConfig"].startswith(f"configuration_{family}.")
    assert ("AutoModel" in auto_map) == (family != "dwatt")
    assert (folder / "model.safetensors").is_file() and not list(folder.glob("*.bin"))
    assert (folder / "tokenizer.json").is_file()
    assert (folder / "generation_config.json").is_file() == (family != "dwatt")
    assert not list(folder.parent.glob(".*tmp-*")) and not list(folder.parent.glob(".*.old-*"))
    listed = list(load_marker(folder).files)  # the export lists every file it wrote, and only those
    assert listed == sorted(p.name for p in folder.iterdir() if p.name != MARKER)

    card_text = (folder / "README.md").read_text()
    meta = metadata_load(folder / "README.md")
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == FAMILIES[family].pipeline_tag
    assert {"custom_code", family} <= set(meta["tags"])
    assert "model-index" not in meta  # no results were given, so none are claimed
    assert re.search(r"\{\{\s*\w+\s*\}\}", card_text) is None  # every placeholder filled
    assert item.repo_id in card_text
    card = ModelCard(card_text)
    assert card.data.license == "apache-2.0"
    params = sum(p.numel() for p in item.model.parameters())
    assert f"{params:,}" in card_text


def test_card_numbers_come_from_the_config(exported):
    dense = (exported["denseformer"].folder / "README.md").read_text()
    assert "dilation k = 2, period p = 2" in dense and "5 × 48" in dense and "[5, 6]" in dense
    moda = (exported["moda"].folder / "README.md").read_text()
    assert "The last layer reads 8 depth entries per KV head" in moda  # 2 (L - 1) with FFN-side K/V, L = 5
    dwatt = (exported["dwatt"].folder / "README.md").read_text()
    assert "`B-person`" in dwatt and "(7)" in dwatt and "2 layers × 32" in dwatt


def test_check_export_folder_names_what_is_missing(exported, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(exported["moda"].folder, copy)
    assert check_export_folder(copy, tokenizer=True, model_card=True) == []
    (copy / "moda_attention.py").unlink()  # imported by modeling_moda.py with a relative import
    (copy / "generation_config.json").unlink()
    (copy / "tokenizer.json").unlink()
    config = json.loads((copy / "config.json").read_text())
    del config["auto_map"]["AutoModel"]
    (copy / "config.json").write_text(json.dumps(config))
    (copy / "README.md").write_text("no front matter")
    problems = "\n".join(check_export_folder(copy, tokenizer=True, model_card=True))
    for needle in ("moda_attention.py", "generation_config.json", "tokenizer vocabulary", "'AutoModel'", "README.md"):
        assert needle in problems, needle
    (copy / "model.safetensors").unlink()
    assert "model.safetensors is missing" in check_export_folder(copy)


def test_interrupted_export_leaves_previous_folder_untouched(tmp_path, monkeypatch):
    model, tokenizer = tiny_denseformer()
    folder = export_model(model, tmp_path / "export", tokenizer=tokenizer, repo_id="me/x")
    before = _digest(folder)

    def broken_save(*args, **kwargs):
        (Path(args[0]) / "tokenizer_config.json").write_text("{half")  # a partial write, then the failure
        raise OSError("disk full while saving the tokenizer")

    monkeypatch.setattr(tokenizer, "save_pretrained", broken_save)
    with pytest.raises(OSError, match="disk full"):
        export_model(model, folder, tokenizer=tokenizer, repo_id="me/x")
    assert _digest(folder) == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no staging or backup folders left behind


def test_incomplete_export_is_refused_and_previous_folder_kept(tmp_path, monkeypatch):
    model, tokenizer = tiny_denseformer()
    folder = export_model(model, tmp_path / "export", tokenizer=tokenizer, repo_id="me/x")
    before = _digest(folder)
    monkeypatch.setattr(GenerationConfig, "save_pretrained", lambda self, *args, **kwargs: None)
    with pytest.raises(ValueError, match="generation_config.json is missing"):
        export_model(model, folder, tokenizer=tokenizer, repo_id="me/x")
    assert _digest(folder) == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    # the plain writer (no check) still writes what it is given
    save_remote_code_folder(model, tmp_path / "plain")
    assert "generation_config.json is missing (a causal LM)" in check_export_folder(tmp_path / "plain")


class FakeHfApi:
    """Records the calls ``push_folder_to_hub`` makes instead of talking to the Hub."""

    instances: list[FakeHfApi] = []

    def __init__(self, token=None, **kwargs):
        self.token = token
        self.calls: list[tuple[str, tuple, dict]] = []
        FakeHfApi.instances.append(self)

    def create_repo(self, *args, **kwargs):
        self.calls.append(("create_repo", args, kwargs))
        return f"https://huggingface.co/{args[0] if args else kwargs['repo_id']}"

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", (), kwargs))
        assert (Path(kwargs["folder_path"]) / "config.json").is_file()  # uploaded while the folder exists

        class Info:
            commit_url = f"https://huggingface.co/{kwargs['repo_id']}/commit/abc123"

        return Info()


def test_push_folder_to_hub_creates_repo_and_uploads(exported, monkeypatch):
    FakeHfApi.instances.clear()
    monkeypatch.setattr("huggingface_hub.HfApi", FakeHfApi)
    folder = exported["denseformer"].folder
    url = push_folder_to_hub(folder, "me/denseformer-tiny", token="hf_secret", private=True,
                             commit_message="first upload")
    assert url == "https://huggingface.co/me/denseformer-tiny/commit/abc123"
    (api,) = FakeHfApi.instances
    assert api.token == "hf_secret"
    (name1, args1, kw1), (name2, _, kw2) = api.calls
    assert name1 == "create_repo" and args1 == ("me/denseformer-tiny",)
    assert kw1["private"] is True and kw1["exist_ok"] is True and kw1["repo_type"] == "model"
    assert name2 == "upload_folder"
    assert kw2["repo_id"] == "me/denseformer-tiny" and Path(kw2["folder_path"]) == folder
    assert kw2["commit_message"] == "first upload" and kw2["token"] == "hf_secret" and kw2["repo_type"] == "model"


def test_push_refuses_incomplete_folders_and_bad_ids_before_any_call(exported, tmp_path, monkeypatch):
    FakeHfApi.instances.clear()
    monkeypatch.setattr("huggingface_hub.HfApi", FakeHfApi)
    with pytest.raises(ValueError, match="user/name"):
        push_folder_to_hub(exported["moda"].folder, "no-namespace", token="t")
    broken = tmp_path / "broken"
    shutil.copytree(exported["moda"].folder, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors is missing"):
        push_folder_to_hub(broken, "me/moda", token="t")
    assert FakeHfApi.instances == []
