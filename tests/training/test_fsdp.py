"""FSDP2 through ``accelerate launch --config_file configs/accelerate/fsdp_cpu.yaml`` on 2 CPU processes (gloo).

For every causal-LM family of the registry, ``scripts/train_clm.py`` (run by ``fsdp_worker.py``, which only lets
accelerate apply FSDP to CPU processes; see its docstring) trains a tiny model for 4 steps with each parameter
sharded over the two ranks, and must

- follow the one-process run on the global batch (losses, gradient norms, evaluation loss, weights; the
  tolerances of ``launch.Tolerance``),
- write sharded checkpoints (one ``.distcp`` file per rank) that resume to the same loss curve and weights,
- export a complete folder (``train_one``'s ``final``, gathered by ``recipes.clm.unsharded_model``) that loads
  with ``AutoModelForCausalLM`` and gives the trained model's logits.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from depthfusion_hf.families import causal_lm_families

from .launch import (
    EPS32,
    PER_RANK_BATCH,
    PROBE_IDS,
    RANKS,
    STEPS,
    assert_matches_single_process,
    launch,
    launcher_command,
    read_results,
    saved_weights,
    train_args,
    training_records,
)

SAVE_AT = 2


# Every family on Llama, and on one other backbone each (issue 30).
LLAMA_RUNS = [(family, "llama") for family in causal_lm_families()]
OTHER_BACKBONE_RUNS = [("denseformer", "gemma3_text"), ("attnres", "phi3"), ("mhc", "olmo2"), ("moda", "qwen3")]


def fsdp_train(corpus_file: Path, family: str, root: Path, resume: bool = False, backbone: str = "llama") -> Path:
    """Launch the FSDP worker for ``family`` on ``backbone`` into ``root/out`` (records in ``root/record``); returns
    ``root``."""
    args = train_args(corpus_file, family, root / "out", PER_RANK_BATCH, save_steps=SAVE_AT, backbone=backbone)
    args += ["--ddp_backend", "gloo"] + (["--resume_from_checkpoint", "latest"] if resume else [])
    launch(launcher_command("accelerate", "fsdp_cpu.yaml"), "fsdp_worker.py", args, root / "record")
    return root


@pytest.fixture(scope="module")
def fsdp_run(request, tmp_path_factory, corpus_file):
    """``(family, backbone, root)`` of one uninterrupted FSDP run per ``(family, backbone)`` parameter: 4 steps,
    sharded checkpoints at 2 and 4."""
    family, backbone = request.param
    root = tmp_path_factory.mktemp(f"fsdp_{family}_{backbone}")
    return family, backbone, fsdp_train(corpus_file, family, root, backbone=backbone)


def _chunk_rows(rows: int, rank: int) -> int:
    """Rows of a ``rows``-row parameter on ``rank`` when FSDP2 shards it along dim 0 over ``RANKS`` ranks."""
    chunks = torch.arange(rows).chunk(RANKS)
    return len(chunks[rank]) if rank < len(chunks) else 0


def rank_reports(root: Path) -> list[dict]:
    return [json.loads((root / "record" / f"rank{r}.json").read_text()) for r in range(RANKS)]


@pytest.mark.integration
@pytest.mark.parametrize("fsdp_run", LLAMA_RUNS + OTHER_BACKBONE_RUNS, indirect=True, ids="-".join)
def test_fsdp_shards_the_model_and_trains_like_one_process(fsdp_run, single_process_run):
    family, backbone, root = fsdp_run
    saved = json.loads((root / "out" / family / "final" / "config.json").read_text())
    assert (saved.get("backbone_config") or {"model_type": "llama"})["model_type"] == backbone
    reports = rank_reports(root)
    assert [r["world_size"] for r in reports] == [RANKS] * RANKS
    # accelerate wrapped each decoder layer (the model's _no_split_modules) and the root as FSDP units ...
    units = set(reports[0]["fsdp_units"])
    layers = {f"model.layers.{i}" for i in range(4)}
    assert {""} | layers <= units, units
    # ... and each rank holds its dim-0 shard of every parameter (FSDP2 shards as torch.chunk does: mHC's
    # three-element `scale` splits 2 + 1).
    shapes = reports[0]["full_shapes"]
    assert sum(math.prod(shape) for shape in shapes) == reports[0]["full_numel"]
    expected = [sum(math.prod(shape[1:]) * _chunk_rows(shape[0], rank) for shape in shapes) for rank in range(RANKS)]
    assert [r["local_numel"] for r in reports] == expected

    init = [torch.load(root / "record" / f"rank{r}_init.pt") for r in range(RANKS)]
    for name in init[0]:
        assert torch.equal(init[0][name], init[1][name]), f"ranks started apart: {name}"
    final = torch.load(root / "record" / "rank0_final.pt")  # gathered on rank 0
    for name in init[0]:
        assert not torch.equal(final[name], init[0][name]), f"{name} did not train"
    reference, reference_out = single_process_run(family, backbone)
    assert_matches_single_process(read_results(root / "out"), final, reference,
                                  saved_weights(reference_out / family / "final"))

    # Sharded checkpoints: every rank wrote its own shard of the model and of the optimizer state.
    for step in (SAVE_AT, STEPS):
        checkpoint = root / "out" / family / f"checkpoint-{step}"
        for part in ("pytorch_model_fsdp_0", "optimizer_0"):
            shards = sorted(p.name for p in (checkpoint / part).glob("*.distcp"))
            assert shards == [f"__{r}_0.distcp" for r in range(RANKS)], (step, part, shards)
        assert not list(checkpoint.glob("*.safetensors"))  # no full copy on the side


@pytest.mark.integration
@pytest.mark.parametrize("fsdp_run", LLAMA_RUNS + OTHER_BACKBONE_RUNS, indirect=True, ids="-".join)
def test_fsdp_export_is_complete_and_gives_the_trained_logits(fsdp_run):
    family, _, root = fsdp_run
    final = torch.load(root / "record" / "rank0_final.pt")
    folder = root / "out" / family / "final"
    exported = saved_weights(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.config.model_type == family
    # Every trained tensor is in the folder, bit for bit; a tied output head is stored once (as the embedding).
    tied = set(model.all_tied_weights_keys)
    assert set(exported) == set(final) - tied
    for name, tensor in exported.items():
        assert torch.equal(tensor, final[name]), name
    # The loaded folder computes what the sharded model computed after training (same weights and operations;
    # kernels may block their float32 reductions differently: a few ulps of the logit scale per block).
    reports = rank_reports(root)
    trained = torch.tensor(reports[0]["logits"])
    torch.testing.assert_close(torch.tensor(reports[1]["logits"]), trained, rtol=0, atol=0)
    with torch.no_grad():
        logits = model(input_ids=PROBE_IDS).logits
    atol = 4 * model.config.num_hidden_layers * EPS32 * trained.abs().max().item()
    torch.testing.assert_close(logits, trained, rtol=0, atol=atol)

    writes = [json.loads(line) for line in (root / "record" / "writes.jsonl").read_text().splitlines()]
    assert [w["rank"] for w in writes if w["what"] == "final folder"] == [0]


def mark_checkpoint(folder: Path) -> None:
    """Tag the checkpoint's log entries so the test can tell which steps the resumed run computed itself."""
    state_file = folder / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for entry in state["log_history"]:
        entry["from_checkpoint"] = True
    state_file.write_text(json.dumps(state))


@pytest.mark.integration
@pytest.mark.parametrize("fsdp_run", LLAMA_RUNS, indirect=True, ids="-".join)
def test_fsdp_resumes_from_a_sharded_checkpoint_on_the_same_curve(fsdp_run, tmp_path, corpus_file):
    family, _, root = fsdp_run
    checkpoint = tmp_path / "out" / family / f"checkpoint-{SAVE_AT}"
    shutil.copytree(root / "out" / family / f"checkpoint-{SAVE_AT}", checkpoint)  # a job killed after step 2
    mark_checkpoint(checkpoint)
    fsdp_train(corpus_file, family, tmp_path, resume=True)

    reference, resumed = training_records(read_results(root / "out")), training_records(read_results(tmp_path / "out"))
    assert sorted(resumed) == sorted(reference) == list(range(1, STEPS + 1))
    # Same ranks, kernels and restored float32 state: the same numbers, up to alignment-dependent kernel paths.
    for step in range(1, STEPS + 1):
        assert resumed[step].get("from_checkpoint", False) == (step <= SAVE_AT), step
        for key in ("loss", "grad_norm", "learning_rate"):
            assert resumed[step][key] == pytest.approx(reference[step][key], rel=4 * EPS32, abs=0), (step, key)
    expected = torch.load(root / "record" / "rank0_final.pt")
    got = torch.load(tmp_path / "record" / "rank0_final.pt")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=4 * EPS32, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert (tmp_path / "out" / family / f"checkpoint-{STEPS}" / "pytorch_model_fsdp_0").is_dir()
