"""`scripts/train_clm.py` runs unchanged under `torchrun` and `accelerate launch` (2 CPU processes, gloo DDP), and
the 2-rank run is the one-process run on the global batch: each rank trained on its own half of every batch."""

from __future__ import annotations

import json

import pytest
import torch

from .launch import (
    PER_RANK_BATCH,
    assert_matches_single_process,
    launch,
    launcher_command,
    read_results,
    saved_weights,
    train_args,
)

FAMILY = "denseformer"


@pytest.mark.integration
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_cpu_ranks_train_like_one_process_on_the_global_batch(launcher, tmp_path, corpus_file,
                                                                  single_process_run):
    record, out = tmp_path / "record", tmp_path / "out"
    args = train_args(corpus_file, FAMILY, out, PER_RANK_BATCH) + ["--ddp_backend", "gloo"]
    launch(launcher_command(launcher), "ddp_worker.py", args, record)

    reports = [json.loads((record / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in reports] == [2, 2]
    assert [r["fsdp_units"] for r in reports] == [[], []]  # plain DDP: every rank holds the whole model
    init = [torch.load(record / f"rank{r}_init.pt") for r in (0, 1)]
    final = [torch.load(record / f"rank{r}_final.pt") for r in (0, 1)]
    assert init[0].keys() == final[0].keys() == final[1].keys()
    for name in init[0]:
        assert torch.equal(init[0][name], init[1][name]), f"ranks started apart: {name}"
        # Both ranks apply the same all-reduced gradient with the same kernels: bitwise equal.
        assert torch.equal(final[0][name], final[1][name]), f"ranks ended apart: {name}"
        assert not torch.equal(final[0][name], init[0][name]), f"{name} did not train"

    # The same losses, gradient norms and weights as one process on batches of 2 x PER_RANK_BATCH blocks.
    reference, reference_out = single_process_run(FAMILY)
    results = read_results(out)
    assert_matches_single_process(results, final[0], reference, saved_weights(reference_out / FAMILY / "final"))

    # Only rank 0 wrote the final folder, the plot and results; what it saved is the trained model.
    writes = [json.loads(line) for line in (record / "writes.jsonl").read_text().splitlines()]
    assert {"rank": 1, "what": "main_process=False"} in writes
    assert {"rank": 0, "what": "main_process=True"} in writes
    assert {w["what"] for w in writes if w["rank"] == 1} == {"main_process=False"}  # rank 1 wrote nothing
    assert {w["what"] for w in writes if w["rank"] == 0} >= {"final folder", "figure"}
    saved = saved_weights(out / FAMILY / "final")
    for name, tensor in saved.items():
        assert torch.equal(tensor, final[0][name]), name
    assert results["args"]["ddp_backend"] == "gloo" and 0 < results["runs"][0]["eval_loss"] < 7
