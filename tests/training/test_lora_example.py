"""``examples/lora_finetune_denseformer.py`` runs as a user would run it and does what it says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

import depthfusion_hf

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lora_finetune_denseformer.py"


def test_lora_example_fine_tunes_saves_reloads_and_merges(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "HF_HOME": str(tmp_path / "hf_home"), "HOME": str(tmp_path), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--pretrain_steps", "30", "--lora_steps", "20"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "outputs" / "lora_denseformer"  # the example writes only under outputs/
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lora_loss"] < summary["base_loss"]  # the adapter learned the Psalms
    assert summary["reload_max_abs_diff"] <= 1e-6  # reloaded (memory-mapped) weights may round differently
    assert summary["merge_max_abs_diff"] < 1e-4
    assert summary["dwa_moved"]
    assert 0 < summary["trainable_parameters"] < 0.2 * summary["total_parameters"]
    assert "adapter reloaded onto a fresh base: max |Δlogits| = 0.0e+00" in proc.stdout

    config = LoraConfig.from_pretrained(out / "adapter")
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert set(config.modules_to_save) == {"dwa"}
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    base = AutoModelForCausalLM.from_pretrained(out / "base")
    assert isinstance(merged, depthfusion_hf.DenseFormerForCausalLM)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert not torch.equal(merged.model.dwa.alphas, base.model.dwa.alphas)  # the merged DWA weights are the tuned ones
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)
