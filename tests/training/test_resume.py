"""Resuming ``scripts/train_clm.py`` from a checkpoint continues the uninterrupted loss curve."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import train_clm  # noqa: E402

STEPS, SAVE_AT = 8, 4


def common_args(corpus_file) -> list[str]:
    """8 steps, a checkpoint every 4, the loss logged every step, evaluation every 3 steps (its RNG use and
    dataloader must not disturb training)."""
    return [
        "--config", str(REPO / "configs" / "clm_tiny.json"), "--max_steps", str(STEPS), "--save_steps", str(SAVE_AT),
        "--logging_steps", "1", "--eval_steps", "3", "--batch_size", "4", "--block_size", "64",
        "--max_train_blocks", "64", "--max_eval_blocks", "4", "--vocab_size", "300", "--train_files", str(corpus_file),
        "--validation_fraction", "0.1", "--dwa_dilation", "2", "--dwa_period", "2",
    ]


def train_curve(run: dict) -> dict[int, dict]:
    """Per-step training records (loss, learning rate, grad norm) of one run's log history."""
    return {h["step"]: h for h in run["log_history"] if "loss" in h}


def mark_checkpoint(folder: Path) -> None:
    """Tag the copied log entries so the test can tell which steps the resumed run computed itself."""
    state_file = folder / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for entry in state["log_history"]:
        entry["from_checkpoint"] = True
    state_file.write_text(json.dumps(state))


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a saved model folder."""
    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus_file):
    """The reference: 8 uninterrupted steps of the DenseFormer and its baseline, checkpoints at 4 and 8."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, train_clm.main(common_args(corpus_file) + ["--output_dir", str(out)])


def assert_same_continuation(reference: dict, resumed: dict) -> None:
    ref, got = train_curve(reference), train_curve(resumed)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        # Steps up to the checkpoint come from its trainer_state; the later ones were computed after resuming.
        assert got[step].get("from_checkpoint", False) == (step <= SAVE_AT), step
    for step in range(SAVE_AT + 1, STEPS + 1):
        for key in ("loss", "learning_rate", "grad_norm"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-5, abs=1e-7), (step, key)
    assert resumed["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)


def test_resume_latest_continues_both_loss_curves(uninterrupted, tmp_path, corpus_file):
    ref_out, reference = uninterrupted
    # A job killed after step 4: only checkpoint-4 of each model exists in its output folder.
    for kind in ("denseformer", "llama"):
        shutil.copytree(ref_out / kind / f"checkpoint-{SAVE_AT}", tmp_path / kind / f"checkpoint-{SAVE_AT}")
        mark_checkpoint(tmp_path / kind / f"checkpoint-{SAVE_AT}")
    resumed = train_clm.main(common_args(corpus_file) + ["--output_dir", str(tmp_path),
                                                         "--resume_from_checkpoint", "latest"])
    assert [r["name"] for r in resumed["runs"]] == ["denseformer 2x2", "llama (baseline)"]
    for ref_run, got_run in zip(reference["runs"], resumed["runs"]):
        assert_same_continuation(ref_run, got_run)
    for kind in ("denseformer", "llama"):
        assert (tmp_path / kind / f"checkpoint-{STEPS}").is_dir()  # training went on and saved again
        ref_w, got_w = final_weights(ref_out / kind / "final"), final_weights(tmp_path / kind / "final")
        assert ref_w.keys() == got_w.keys()
        for name in ref_w:
            torch.testing.assert_close(got_w[name], ref_w[name], rtol=1e-5, atol=1e-6, msg=f"{kind}: {name}")


def test_resume_from_an_explicit_checkpoint_path(uninterrupted, tmp_path, corpus_file):
    ref_out, reference = uninterrupted
    checkpoint = tmp_path / "saved" / f"checkpoint-{SAVE_AT}"
    shutil.copytree(ref_out / "denseformer" / f"checkpoint-{SAVE_AT}", checkpoint)
    mark_checkpoint(checkpoint)
    resumed = train_clm.main(common_args(corpus_file) + [
        "--output_dir", str(tmp_path / "run"), "--no_baseline", "--resume_from_checkpoint", str(checkpoint)])
    assert_same_continuation(reference["runs"][0], resumed["runs"][0])
    dwa = final_weights(tmp_path / "run" / "denseformer" / "final")["model.dwa.alphas"]
    torch.testing.assert_close(dwa, final_weights(ref_out / "denseformer" / "final")["model.dwa.alphas"])


def test_resume_latest_without_a_checkpoint_is_an_error(tmp_path, corpus_file):
    with pytest.raises(ValueError, match="No valid checkpoint"):
        train_clm.main(common_args(corpus_file) + ["--output_dir", str(tmp_path), "--no_baseline",
                                                   "--max_steps", "2", "--resume_from_checkpoint", "latest"])
