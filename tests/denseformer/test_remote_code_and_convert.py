"""Remote-code export (fresh process, no depthfusion_hf, no Triton, offline) and Llama upcycling."""

import pytest
import torch
from transformers import LlamaForCausalLM

from depthfusion_hf import DenseFormerForCausalLM
from depthfusion_hf.convert import llama_to_denseformer
from depthfusion_hf.export import save_remote_code_folder
from tests.fresh_process import run_fresh

from .helpers import randomise_dwa, tiny_config, tiny_llama_config


def test_remote_code_loads_in_fresh_process(tmp_path):
    model = DenseFormerForCausalLM(tiny_config(dwa_dilation=2, dwa_period=2)).eval()
    randomise_dwa(model)
    folder = save_remote_code_folder(model, tmp_path / "export")
    for name in ("configuration_denseformer.py", "modeling_denseformer.py", "dwa.py", "model.safetensors"):
        assert (folder / name).exists(), name
    ids = torch.randint(3, 97, (2, 9))
    torch.save({"ids": ids, "logits": model(ids).logits.detach()}, tmp_path / "expected.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_fresh(
        f"""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__name__ == "DenseFormerForCausalLM", type(model)
        assert "depthfusion_hf" not in type(model).__module__
        with torch.no_grad():
            diff = (model(expected["ids"]).logits - expected["logits"]).abs().max().item()
        base = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True)
        print("DIFF", diff, type(base).__name__)
        """,
        cwd=str(elsewhere),
        hf_home=str(tmp_path / "hf_home"),
    )
    diff = float(out.split("DIFF")[1].split()[0])
    assert diff <= 1e-6  # memory-mapped (possibly misaligned) weights may change float rounding
    assert "DenseFormerModel" in out


def test_export_is_atomic(tmp_path, monkeypatch):
    model = DenseFormerForCausalLM(tiny_config())
    folder = save_remote_code_folder(model, tmp_path / "export")
    before = sorted(p.name for p in folder.iterdir())

    def broken_save(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(DenseFormerForCausalLM, "save_pretrained", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        save_remote_code_folder(model, folder)
    assert sorted(p.name for p in folder.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


@pytest.mark.parametrize("k,p", [(1, 1), (4, 5), (2, 3)])
def test_llama_upcycling_identical_logits(k, p, tmp_path):
    llama = LlamaForCausalLM(tiny_llama_config()).eval()
    ids = torch.randint(3, 97, (2, 10))
    dense = llama_to_denseformer(llama, dwa_dilation=k, dwa_period=p)
    assert isinstance(dense, DenseFormerForCausalLM)
    assert (dense.config.dwa_dilation, dense.config.dwa_period) == (k, p)
    with torch.no_grad():
        assert (dense(ids).logits - llama(ids).logits).abs().max().item() <= 1e-5
    llama.save_pretrained(tmp_path / "llama")
    from_folder = llama_to_denseformer(tmp_path / "llama", dwa_dilation=k, dwa_period=p).eval()
    with torch.no_grad():
        assert (from_folder(ids).logits - llama(ids).logits).abs().max().item() <= 1e-5


def test_upcycling_rejects_non_llama():
    with pytest.raises(ValueError, match="expected a LlamaForCausalLM"):
        llama_to_denseformer(torch.nn.Linear(2, 2))
