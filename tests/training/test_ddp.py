"""`scripts/train_clm.py` runs unchanged under `torchrun` and `accelerate launch` (2 CPU processes, gloo DDP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIN = Path(sys.executable).parent


def launcher_command(launcher: str) -> list[str]:
    """The command that starts 2 local CPU processes of the worker."""
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "29541"]
    return [str(BIN / "accelerate"), "launch", "--config_file", str(REPO / "configs" / "accelerate" / "cpu_ddp.yaml")]


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_cpu_ranks_train_to_identical_weights(launcher, tmp_path, corpus_file):
    record, out = tmp_path / "record", tmp_path / "out"
    args = [
        "--config", str(REPO / "configs" / "clm_tiny.json"), "--max_steps", "3", "--eval_steps", "0",
        "--batch_size", "2", "--block_size", "64", "--max_train_blocks", "32", "--max_eval_blocks", "2",
        "--vocab_size", "300", "--no_baseline", "--dwa_dilation", "2", "--train_files", str(corpus_file),
        "--validation_fraction", "0.1", "--ddp_backend", "gloo", "--output_dir", str(out),
    ]
    env = os.environ | {"DEPTHFUSION_DDP_RECORD": str(record), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(launcher_command(launcher) + [str(HERE / "ddp_worker.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]

    assert [(record / f"rank{r}_world.txt").read_text() for r in (0, 1)] == ["2", "2"]
    init = [torch.load(record / f"rank{r}_init.pt") for r in (0, 1)]
    final = [torch.load(record / f"rank{r}_final.pt") for r in (0, 1)]
    assert init[0].keys() == final[0].keys() == final[1].keys()
    for name in init[0]:
        assert torch.equal(init[0][name], init[1][name]), f"ranks started apart: {name}"
        assert torch.equal(final[0][name], final[1][name]), f"ranks ended apart: {name}"
        assert not torch.equal(final[0][name], init[0][name]), f"{name} did not train"

    # Only rank 0 wrote the final folder, the plot and results; what it saved is the trained model.
    writes = [json.loads(line) for line in (record / "writes.jsonl").read_text().splitlines()]
    assert {"rank": 1, "what": "main_process=False"} in writes
    assert {"rank": 0, "what": "main_process=True"} in writes
    assert sorted(w["what"] for w in writes if w["rank"] == 1) == ["main_process=False"]
    assert {w["what"] for w in writes if w["rank"] == 0} >= {"final folder", "dwa heatmap"}
    saved = load_file(out / "denseformer" / "final" / "model.safetensors")
    for name, tensor in saved.items():
        assert torch.equal(tensor, final[0][name]), name
    results = json.loads((out / "results.json").read_text())
    assert results["args"]["ddp_backend"] == "gloo" and 0 < results["runs"][0]["eval_loss"] < 7
