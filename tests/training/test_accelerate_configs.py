"""The accelerate configs in ``configs/accelerate/`` parse with accelerate's own loader and say what the docs say."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "accelerate"


def test_every_config_is_documented():
    docs = (CONFIGS.parents[1] / "docs" / "TRAINING.md").read_text()
    names = sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert names == ["cpu_ddp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "fsdp.yaml", "fsdp_cpu.yaml"]
    for name in names:
        assert f"configs/accelerate/{name}" in docs, name


@pytest.mark.parametrize(("name", "kind"), [("cpu_ddp.yaml", DistributedType.MULTI_GPU),
                                            ("fsdp.yaml", DistributedType.FSDP),
                                            ("fsdp_cpu.yaml", DistributedType.FSDP),
                                            ("deepspeed_zero2.yaml", DistributedType.DEEPSPEED),
                                            ("deepspeed_zero3.yaml", DistributedType.DEEPSPEED)])
def test_config_loads(name, kind):
    config = load_config_from_file(str(CONFIGS / name))
    assert config.distributed_type == kind
    if name == "cpu_ddp.yaml":
        assert config.num_processes == 2  # the DDP test launches it: two CPU processes (torchrun under the hood)
    if name.startswith("fsdp"):
        # No explicit wrap class: accelerate falls back to the model's `_no_split_modules`
        # (DenseFormerDecoderLayer / MoDADecoderLayer / LlamaDecoderLayer): test_fsdp.py checks the units it made.
        assert "fsdp_transformer_layer_cls_to_wrap" not in config.fsdp_config
        assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    if name == "fsdp_cpu.yaml":
        # What the FSDP test launches: two CPU processes in float32 (the GPU config uses bf16 on 8 GPUs).
        assert config.num_processes == 2 and config.use_cpu and config.mixed_precision == "no"
    if name.startswith("deepspeed"):
        stage = int(name[-6])
        assert config.deepspeed_config["zero_stage"] == stage
        if stage == 3:
            assert config.deepspeed_config["zero3_save_16bit_model"] is True
