"""``ddp_worker.py`` under FSDP on CPU: ``accelerate launch --config_file configs/accelerate/fsdp_cpu.yaml``.

accelerate turns an FSDP launch on a machine without GPUs into plain DDP: the Trainer asks for CPU processes,
``PartialState`` classifies them as ``MULTI_CPU``, and ``AcceleratorState`` only switches to ``FSDP`` when the
processes are ``MULTI_GPU`` (or another accelerator) — the FSDP plugin built from the launch config is dropped
without a word (``trainer.is_fsdp_enabled`` is False, the model is wrapped in ``DistributedDataParallel``).
FSDP2 itself (``fully_shard``) runs on CPU with gloo, so this worker makes the one decision accelerate makes
for GPUs: after ``AcceleratorState`` is built with an FSDP plugin on ``MULTI_CPU`` processes it sets the
distributed type to ``FSDP`` and keeps the plugin, exactly as ``AcceleratorState.__init__`` does for
``MULTI_GPU`` (and records the type in ``PartialState``, which later ``AcceleratorState()`` calls copy).
Everything else — wrapping, sharded checkpoints, the gathered export — is accelerate's and the recipe's own.

    accelerate launch --config_file configs/accelerate/fsdp_cpu.yaml tests/training/fsdp_worker.py <arguments>
"""

from __future__ import annotations

import sys

import ddp_worker
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType


def run_fsdp_on_cpu_processes() -> None:
    """Let an FSDP plugin take effect on CPU processes (see the module docstring)."""
    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = __init__


if __name__ == "__main__":
    run_fsdp_on_cpu_processes()
    ddp_worker.main(sys.argv[1:])
