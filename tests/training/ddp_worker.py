"""Run ``scripts/train_clm.py`` unchanged under a launcher, recording what each rank did (used by the DDP test).

The worker wraps three functions the script calls — ``train_one`` (to dump the rank's parameters
before and after training), ``save_remote_code_folder`` and the plot functions (to log which rank
wrote outputs) — then calls ``train_clm.main`` with the command line it was given. Records go to
``$DEPTHFUSION_DDP_RECORD``: ``rank{r}_init.pt``, ``rank{r}_final.pt`` (state dicts) and
``writes.jsonl`` (one ``{"rank", "what"}`` line per output written, and each rank's ``is_main_process()``).

    torchrun --nproc_per_node 2 tests/training/ddp_worker.py <train_clm.py arguments>
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import train_clm  # noqa: E402

import depthfusion_hf.recipes.clm as clm  # noqa: E402

RECORD = Path(os.environ["DEPTHFUSION_DDP_RECORD"])
RANK = int(os.environ.get("RANK", "0"))


def _log_write(what: str) -> None:
    with open(RECORD / "writes.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"rank": RANK, "what": what}) + "\n")


def _state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}


def _wrap_train_one(original):
    def train_one(name, model, *args, **kwargs):
        torch.save(_state(model), RECORD / f"rank{RANK}_init.pt")
        result = original(name, model, *args, **kwargs)
        torch.save(_state(model), RECORD / f"rank{RANK}_final.pt")
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        (RECORD / f"rank{RANK}_world.txt").write_text(str(world))
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


if __name__ == "__main__":
    RECORD.mkdir(parents=True, exist_ok=True)
    train_clm.train_one = _wrap_train_one(train_clm.train_one)
    clm.save_remote_code_folder = _wrap_writer(clm.save_remote_code_folder, "final folder")
    train_clm.plot_dwa_heatmap = _wrap_writer(train_clm.plot_dwa_heatmap, "dwa heatmap")
    train_clm.is_main_process = _wrap_is_main_process(train_clm.is_main_process)
    train_clm.main(sys.argv[1:])
