"""Run ``scripts/train_clm.py`` unchanged under a launcher, recording what each rank did (DDP and FSDP tests).

The worker wraps what the script calls — ``train_one`` (to dump the rank's parameters before and after
training), ``save_remote_code_folder`` and matplotlib's ``Figure.savefig`` (to log which rank wrote outputs) —
then calls ``train_clm.main`` with the command line it was given. Records go to ``$DEPTHFUSION_DDP_RECORD``:

- ``rank{r}_init.pt`` / ``rank{r}_final.pt``: the model's state dict before and after training. Under FSDP the
  trained parameters are shards (DTensors): ``rank0_final.pt`` holds the full tensors gathered on rank 0 and
  the other ranks' files are empty.
- ``rank{r}.json``: world size, the number of parameter entries this rank holds (its local shards under FSDP),
  the modules that are FSDP units, and (rank 0) the trained model's logits on ``launch.PROBE_IDS``.
- ``writes.jsonl``: one ``{"rank", "what"}`` line per output written, and each rank's ``is_main_process()``.

    torchrun --nproc_per_node 2 tests/training/ddp_worker.py <train_clm.py arguments>
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

import train_clm  # noqa: E402

import depthfusion_hf.recipes.clm as clm  # noqa: E402
from tests.training.launch import PROBE_IDS  # noqa: E402

RECORD = Path(os.environ["DEPTHFUSION_DDP_RECORD"])
RANK = int(os.environ.get("RANK", "0"))


def _log_write(what: str) -> None:
    with open(RECORD / "writes.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"rank": RANK, "what": what}) + "\n")


def _is_sharded(model) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _state(model) -> dict[str, torch.Tensor]:
    """Full tensors: the plain state dict, or under FSDP the gathered one (a collective; rank 0 gets it)."""
    if _is_sharded(model):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}


def _probe_logits(model) -> list:
    """The trained model's logits on ``PROBE_IDS`` (every rank runs the forward: FSDP gathers in it)."""
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE_IDS).logits.tolist()


def _wrap_train_one(original):
    def train_one(name, model, *args, **kwargs):
        torch.save(_state(model), RECORD / f"rank{RANK}_init.pt")
        result = original(name, model, *args, **kwargs)
        torch.save(_state(model), RECORD / f"rank{RANK}_final.pt")
        report = {
            "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
            "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()),
            "full_numel": sum(p.numel() for p in model.parameters()),
            "full_shapes": [list(p.shape) for p in model.parameters()],  # a DTensor's shape is global
            "fsdp_units": [n for n, m in model.named_modules() if isinstance(m, FSDPModule)],
            "logits": _probe_logits(model),
        }
        (RECORD / f"rank{RANK}.json").write_text(json.dumps(report))
        return result

    return train_one


def _wrap_writer(original, what: str):
    def writer(*args, **kwargs):
        _log_write(what)
        return original(*args, **kwargs)

    return writer


def _wrap_is_main_process(original):
    def is_main_process() -> bool:
        answer = original()
        _log_write(f"main_process={answer}")
        return answer

    return is_main_process


def main(argv: list[str]) -> None:
    """Install the recorders and run ``train_clm.main(argv)``."""
    RECORD.mkdir(parents=True, exist_ok=True)
    train_clm.train_one = _wrap_train_one(train_clm.train_one)
    clm.save_remote_code_folder = _wrap_writer(clm.save_remote_code_folder, "final folder")
    Figure.savefig = _wrap_writer(Figure.savefig, "figure")
    train_clm.is_main_process = _wrap_is_main_process(train_clm.is_main_process)
    train_clm.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
