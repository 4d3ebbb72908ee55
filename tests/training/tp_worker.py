"""Tensor-parallel check, run under ``torchrun --nproc_per_node 2`` (gloo on CPU).

Loads each saved folder twice — plainly and with ``tp_plan="auto"`` — and writes, per rank, the
largest logit difference and the local (sharded) shapes of some projections to ``<record>/rank{r}.json``.

    torchrun --nproc_per_node 2 tests/training/tp_worker.py <record dir> <folder> [<folder> ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import depthfusion_hf  # noqa: F401  (registers the model types)


def local_shape(weight: torch.Tensor) -> list[int]:
    """The shape this rank holds: the local shard of a DTensor, else the tensor's own shape."""
    return list(weight.to_local().shape) if hasattr(weight, "to_local") else list(weight.shape)


def main(record: Path, folders: list[str]) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    report = {"world_size": torch.distributed.get_world_size()}
    ids = torch.arange(3, 27).view(2, 12)
    for folder in folders:
        plain = AutoModelForCausalLM.from_pretrained(folder).eval()
        sharded = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto").eval()
        with torch.no_grad():
            expected = plain(ids).logits
            got = sharded(ids).logits
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        layer = sharded.model.layers[0]
        shapes = {name: local_shape(module.weight) for name, module in layer.named_modules()
                  if isinstance(module, torch.nn.Linear)}
        report[Path(folder).name] = {"max_diff": (expected - got).abs().max().item(), "local_shapes": shapes}
    (record / f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
