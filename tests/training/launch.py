"""Shared pieces of the multi-process training tests: launch ``scripts/train_clm.py`` on 2 CPU ranks, run the
single-process reference on the global batch, and read what the runs recorded.

A 2-rank run with per-rank batch ``b`` must follow the same trajectory as one process with batch ``2b``: the
distributed sampler deals the global batch of each step to the ranks (rank 0 the first ``b`` blocks, rank 1 the
next ``b``), and DDP / FSDP average the gradients, whereas the single process averages over all ``2b`` blocks
at once. Every block has the same number of tokens, so the two means are equal in exact arithmetic; in float32
only the order of the reductions differs (see :class:`Tolerance`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "scripts"))

import train_clm  # noqa: E402

PER_RANK_BATCH, RANKS = 2, 2
STEPS, LEARNING_RATE, TOKENS_PER_BLOCK = 4, 2e-3, 64  # --max_steps, --learning_rate, --block_size
EPS32 = torch.finfo(torch.float32).eps
# Fixed token ids on which the workers and the tests compare trained models' logits ([2, 16], vocabulary 300).
PROBE_IDS = (torch.arange(32).view(2, 16) * 37 + 5) % 300


def free_port() -> int:
    """A TCP port no process listens on now (so parallel test runs do not share a rendezvous port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_command(launcher: str, accelerate_config: str = "cpu_ddp.yaml") -> list[str]:
    """The command that starts 2 local CPU processes: ``torchrun`` or ``accelerate launch --config_file``."""
    port = str(free_port())
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--nproc_per_node", str(RANKS), "--master_port", port]
    config = REPO / "configs" / "accelerate" / accelerate_config
    return [str(BIN / "accelerate"), "launch", "--config_file", str(config), "--main_process_port", port]


def tiny_config(backbone: str, folder: Path) -> Path:
    """``configs/clm_tiny.json`` (a Llama), or a config file in ``folder`` that puts its sizes into a
    ``backbone_config`` of the decoder ``backbone`` (issue 30: the families on Qwen3, Gemma 3, OLMo 2, ...)."""
    tiny = REPO / "configs" / "clm_tiny.json"
    if backbone == "llama":
        return tiny
    sizes = {key: value for key, value in json.loads(tiny.read_text()).items() if not key.startswith("_")}
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    path = folder / f"clm_tiny_{backbone}.json"
    path.write_text(json.dumps({"backbone_config": {"model_type": backbone, "head_dim": head_dim, **sizes},
                                "tie_word_embeddings": sizes["tie_word_embeddings"]}))
    return path


def train_args(corpus_file: Path, family: str, output_dir: Path, batch_size: int, steps: int = STEPS,
               save_steps: int = 0, backbone: str = "llama") -> list[str]:
    """``train_clm.py`` arguments of the comparison: tiny model on ``backbone``, ``steps`` steps, the loss logged every
    step."""
    return [
        "--model", family, "--config", str(tiny_config(backbone, output_dir.parent)), "--max_steps", str(steps),
        "--learning_rate", str(LEARNING_RATE), "--save_steps", str(save_steps), "--logging_steps", "1",
        "--eval_steps", "0", "--batch_size", str(batch_size), "--block_size", str(TOKENS_PER_BLOCK),
        "--max_train_blocks", "32", "--max_eval_blocks", "2", "--vocab_size", "300", "--no_baseline",
        "--train_files", str(corpus_file), "--validation_fraction", "0.1", "--output_dir", str(output_dir),
    ]


def launch(command: list[str], worker: str, args: list[str], record: Path, timeout: int = 240) -> None:
    """Run ``worker`` (a file in this folder) under ``command`` with ``args``; fail with the ranks' stderr."""
    env = os.environ | {"DEPTHFUSION_DDP_RECORD": str(record), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(command + [str(HERE / worker), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]


def single_process(corpus_file: Path, family: str, output_dir: Path, steps: int = STEPS,
                   backbone: str = "llama") -> dict:
    """The reference: one process, batch ``RANKS * PER_RANK_BATCH`` (the global batch), otherwise the same run."""
    return train_clm.main(train_args(corpus_file, family, output_dir, RANKS * PER_RANK_BATCH, steps,
                                     backbone=backbone))


def saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of an exported model folder."""
    return load_file(folder / "model.safetensors")


def read_results(output_dir: Path) -> dict:
    """``results.json`` written by rank 0."""
    return json.loads((output_dir / "results.json").read_text())


@dataclass(frozen=True)
class Tolerance:
    """How far a 2-rank run may drift from one process on the global batch in float32 (see :data:`REDUCTION`).

    Per step the two runs add the same float32 terms in another order: each rank averages the loss and every
    gradient entry over its ``N = 2 × 64`` tokens and the all-reduce averages the two, instead of one mean over
    ``2N`` tokens; the backward matmuls split their reductions over the batch the same way. Reordering a sum of
    ``2N`` terms changes it by at most ``2N·eps·Σ|terms|``, typically by about ``sqrt(2N)·eps`` relative.
    Differences compound over the steps, hence:

    - ``loss_rtol`` = ``steps · sqrt(2N) · eps`` for each logged loss and gradient norm and the evaluation loss
      (4 · 16 · eps = 7.6e-6; measured: at most 2.5e-7). A loss is one mean over all tokens, so the typical
      error applies.
    - ``weight_atol`` = ``lr · steps · 2N · eps`` (2.4e-7): AdamW normalises each update to about ``lr``, so a
      gradient entry with relative error ``ρ`` moves its weight by at most ``lr·ρ`` more or less. The largest of
      the 170k weight differences comes from the tail, where cancellation in a gradient sum makes its relative
      error large, so the worst-case reordering bound ``ρ = 2N·eps`` is used (measured: 3.4e-8 on a q_proj
      weight of size 0.04). ``weight_rtol`` = ``2·eps`` adds the final rounding of each weight (1 ulp measured
      on norm weights of size 1).

    - ``noise_atol`` = ``2 · lr · steps`` for mHC's hyper-connection parameters (``*_hc.*``): the part of them that
      feeds only ``comb`` has an exactly zero gradient at layer 0 (the n streams there are copies of the embedding,
      and ``combᵀ X = X`` for every doubly-stochastic ``comb``) and a tiny one in the next layers, so float32
      rounding noise is as large as the signal (float64: 3.5e-19, float32: 1e-10, measured), and AdamW, which
      scales each entry to a step of at most ``lr`` (β1 = 0.9, β2 = 0.95: ``1 − β1 ≤ sqrt(1 − β2)``), moves them by
      noise-determined amounts (measured: 1.1e-5). Adam's step bound is the only sound one; the step losses and
      gradient norms above, which include these parameters, are held to ``loss_rtol``. The same holds for the
      last DWA weight of a DenseFormer whose last block ends with a DWA step, ``alpha[d, d]`` (the last entry of
      ``dwa.alphas``): the final RMSNorm is invariant to scaling its input ``Y_d``, so at the identity init (``Y_d =
      X_d``) its gradient is zero but for the norm's eps and rounding (measured: 2.5e-4 apart after 4 steps on a
      Gemma 3 backbone, within ``weight_atol`` on Llama); the DWA's other weights are held to ``weight_atol``.

    A run whose ranks trained on the wrong blocks is far outside: one process on a single rank's half of each
    batch differs from the 2-rank run by 8e-4 to 1e-2 relative in the step losses (measured), 100 to 1000 times
    ``loss_rtol``.
    """

    loss_rtol: float
    weight_rtol: float
    weight_atol: float
    noise_atol: float


_GLOBAL_TOKENS = RANKS * PER_RANK_BATCH * TOKENS_PER_BLOCK
REDUCTION = Tolerance(loss_rtol=STEPS * _GLOBAL_TOKENS**0.5 * EPS32, weight_rtol=2 * EPS32,
                      weight_atol=LEARNING_RATE * STEPS * _GLOBAL_TOKENS * EPS32,
                      noise_atol=2 * LEARNING_RATE * STEPS)


def training_records(results: dict) -> dict[int, dict]:
    """``{step: log entry}`` of the logged training steps of the first run in a ``results.json``-shaped dict."""
    return {h["step"]: h for h in results["runs"][0]["log_history"] if "loss" in h}


def assert_matches_single_process(results: dict, weights: dict[str, torch.Tensor], reference: dict,
                                  reference_weights: dict[str, torch.Tensor]) -> None:
    """The 2-rank run's losses, gradient norms, evaluation loss and trained weights equal the reference's within
    :data:`REDUCTION`; ``weights`` may hold tied entries the exported ``reference_weights`` leave out."""
    got, ref = training_records(results), training_records(reference)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=REDUCTION.loss_rtol, abs=0), (step, key)
    assert results["runs"][0]["eval_loss"] == pytest.approx(reference["runs"][0]["eval_loss"],
                                                            rel=REDUCTION.loss_rtol, abs=0)
    assert results["runs"][0]["parameters"] == reference["runs"][0]["parameters"]
    assert set(reference_weights) <= set(weights)
    for name, expected in reference_weights.items():
        got = weights[name]
        if name.endswith("dwa.alphas"):  # alpha[d, d] is noise-determined (see Tolerance)
            torch.testing.assert_close(got[-1:], expected[-1:], rtol=0, atol=REDUCTION.noise_atol)
            got, expected = got[:-1], expected[:-1]
        atol = REDUCTION.noise_atol if "_hc." in name else REDUCTION.weight_atol
        torch.testing.assert_close(got, expected, rtol=REDUCTION.weight_rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")
