"""``_no_split_modules``, ``device_map="auto"`` and the tensor-parallel plans of the three families."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from .builders import tiny_denseformer, tiny_dwatt, tiny_moda, token_batch

HERE = Path(__file__).resolve().parent
BUILDERS = {"denseformer": tiny_denseformer, "moda": tiny_moda, "dwatt": tiny_dwatt}
DECODER_LAYERS = {"denseformer": "LlamaDecoderLayer",  # the backbone's own layer (issue 30)
                  "moda": "MoDADecoderLayer", "dwatt": "BertLayer"}


def plan_regex(pattern: str) -> re.Pattern:
    """transformers' plan patterns: ``*`` stands for one layer index."""
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+"))


@pytest.mark.parametrize("family", ["denseformer", "moda", "dwatt"])
def test_no_split_modules_name_real_classes(family):
    model = BUILDERS[family]()
    classes = {type(module).__name__ for module in model.modules()}
    declared = set(type(model)._no_split_modules or ())
    assert declared, f"{family} declares no _no_split_modules"
    # Collected from the class and its sub-models: the decoder / encoder layer is never split.
    assert DECODER_LAYERS[family] in model._no_split_modules
    present = declared & classes
    assert present, f"none of {declared} is a module class of {family}"
    if family == "dwatt":
        assert "DWAttDepthAttention" in present  # the fusion head reads every layer at once


@pytest.mark.parametrize("family", ["denseformer", "moda", "dwatt"])
def test_device_map_auto_loads_with_identical_logits(family, tmp_path):
    model = BUILDERS[family]()
    model.save_pretrained(tmp_path / "model")
    auto_class = AutoModelForTokenClassification if family == "dwatt" else AutoModelForCausalLM
    ids = token_batch(100)
    with torch.no_grad():  # the reference: the same folder loaded without a device map
        expected = auto_class.from_pretrained(tmp_path / "model").eval()(input_ids=ids).logits
    mapped = auto_class.from_pretrained(tmp_path / "model", device_map="auto").eval()
    assert {p.device.type for p in mapped.parameters()} == {"cpu"}
    with torch.no_grad():
        torch.testing.assert_close(mapped(input_ids=ids).logits, expected, rtol=0, atol=0)

    # Half the weights' bytes of CPU memory: accelerate splits the model at `_no_split_modules` boundaries and
    # offloads the rest to disk, loading each piece when its module runs (the DWA weights included).
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    offloaded = auto_class.from_pretrained(tmp_path / "model", device_map="auto", max_memory={"cpu": size // 2},
                                           offload_folder=str(tmp_path / "offload")).eval()
    assert "disk" in set(offloaded.hf_device_map.values())
    for name in offloaded.hf_device_map:  # never inside a block / fusion head
        assert not re.search(r"layers?\.\d+\.|fusion\.", name), name
    with torch.no_grad():
        torch.testing.assert_close(offloaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["denseformer", "moda"])
def test_tp_plan_patterns_match_modules_and_cover_every_block_linear(family):
    model = BUILDERS[family]()
    plan = model.tp_plan
    names = [name for name, _ in model.named_modules()]
    for pattern in plan:
        regex = plan_regex(pattern)
        assert any(regex.fullmatch(name) for name in names), f"{family} tp plan entry {pattern!r} matches no module"
    block_linears = [name for name, module in model.named_modules()
                     if isinstance(module, nn.Linear) and name.startswith("model.layers.")]
    for name in block_linears:
        assert any(plan_regex(p).fullmatch(name) for p in plan), f"{name} is not in the {family} tp plan"
    assert plan["lm_head"] == "colwise_gather_output"
    if family == "moda":
        assert plan["model.layers.*.ffn_kv_proj"] == "colwise"
        assert any(n.endswith("ffn_kv_proj") for n in block_linears)


def test_tensor_parallel_two_cpu_ranks_match_single_process(tmp_path):
    folders = []
    for family in ("denseformer", "moda"):
        BUILDERS[family]().save_pretrained(tmp_path / family)
        folders.append(str(tmp_path / family))
    record = tmp_path / "record"
    record.mkdir()
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "--master_port", "29561", str(HERE / "tp_worker.py"),
         str(record), *folders],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads((record / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        assert report["world_size"] == 2
        for family in ("denseformer", "moda"):
            assert report[family]["max_diff"] < 1e-5, (family, report[family]["max_diff"])
            shapes = report[family]["local_shapes"]
            # Column-wise: half the output rows on each rank; row-wise: half the input columns.
            assert shapes["self_attn.q_proj"] == [32, 64] and shapes["self_attn.k_proj"] == [16, 64]
            assert shapes["self_attn.o_proj"] == [64, 32] and shapes["mlp.down_proj"] == [64, 64]
    moda_shapes = reports[0]["moda"]["local_shapes"]
    assert moda_shapes["ffn_kv_proj"] == [32, 64]  # 2 * Hkv * d = 64 rows, one KV head per rank
