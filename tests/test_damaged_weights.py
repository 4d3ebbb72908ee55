"""A damaged weights file is named on load, for every family, from the package and as remote code (before, a
truncated ``model.safetensors`` gave safetensors' ``incomplete metadata, file not fully covered``, naming no
file)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, BertConfig

from depthfusion_hf import (
    AttnResConfig,
    AttnResForCausalLM,
    DenseFormerConfig,
    DenseFormerForCausalLM,
    DWAttConfig,
    DWAttForTokenClassification,
    MHCConfig,
    MHCForCausalLM,
    MoDAConfig,
    MoDAForCausalLM,
)
from depthfusion_hf.export import save_remote_code_folder
from tests.fresh_process import run_fresh

TINY = dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=20)
FAMILIES = {
    "denseformer": (lambda: DenseFormerForCausalLM(DenseFormerConfig(**TINY)), AutoModelForCausalLM),
    "moda": (lambda: MoDAForCausalLM(MoDAConfig(**TINY)), AutoModelForCausalLM),
    "attnres": (lambda: AttnResForCausalLM(AttnResConfig(**TINY)), AutoModelForCausalLM),
    "mhc": (lambda: MHCForCausalLM(MHCConfig(**TINY)), AutoModelForCausalLM),
    "dwatt": (lambda: DWAttForTokenClassification(DWAttConfig(backbone_config=BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=20),
        num_labels=3)), AutoModelForTokenClassification),
}


def truncate(path, by: int = 100) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - by])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("remote_code", [False, True], ids=["package", "remote_code"])
def test_a_truncated_weights_file_is_named_on_load(family, remote_code, tmp_path):
    build, auto_class = FAMILIES[family]
    model = build()
    folder = save_remote_code_folder(model, tmp_path / "export")
    weights = folder / "model.safetensors"
    truncate(weights)
    loads = [lambda: auto_class.from_pretrained(folder, trust_remote_code=True)] if remote_code else [
        lambda: type(model).from_pretrained(folder), lambda: auto_class.from_pretrained(folder)]
    for load in loads:
        with pytest.raises(OSError) as error:
            load()
        message = str(error.value)
        assert f"cannot load the weights of {folder}" in message and f"{weights}:" in message, message
        assert "incomplete metadata" in message  # safetensors' own words stay


def test_a_damaged_file_is_named_in_a_process_without_depthfusion_hf(tmp_path):
    folder = save_remote_code_folder(MHCForCausalLM(MHCConfig(**TINY)), tmp_path / "export")
    truncate(folder / "model.safetensors", by=1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_fresh(f"""
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        except OSError as error:
            print("ERROR", error)
        """, cwd=str(elsewhere), hf_home=str(tmp_path / "hf_home"))
    assert f"ERROR cannot load the weights of {folder}" in out and f"{folder / 'model.safetensors'}:" in out, out


def test_an_intact_folder_still_loads_with_identical_weights(tmp_path):
    model = MHCForCausalLM(MHCConfig(**TINY)).eval()
    folder = save_remote_code_folder(model, tmp_path / "export")
    again = MHCForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
