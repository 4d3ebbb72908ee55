"""``benchmarks/bench_moda_floor.py``: the depth pool's byte count against hand counts; a toy run's table and record."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from depthfusion_hf import MoDAConfig

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_moda_floor.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_moda_floor", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _config(layers: int, ffn_kv: bool, kv_heads: int = 2, window: int | None = None) -> MoDAConfig:
    return MoDAConfig(num_hidden_layers=layers, hidden_size=128, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=kv_heads, vocab_size=64, moda_ffn_kv=ffn_kv, moda_depth_window=window)


# Slot s = B T Hkv d * 4 bytes. Reader l with window M_l reads 4 M_l slots (K, V forward; V, K backward); writer w
# reads q and dO ([N, G, d] each) of its R_w readers: 2 G R_w slots.
@pytest.mark.parametrize("layers, ffn_kv, kv_heads, window, slots", [
    (2, True, 2, None, 4 * 2 + 2 * 1 * 1),  # M = 0, 2; writer 0 has reader 1 (G = 1)
    (2, False, 2, None, 4 * 1 + 2 * 1 * 1),  # M = 0, 1
    (2, True, 1, None, 4 * 2 + 2 * 2 * 1),  # G = 2: q, dO are two slots each
    (3, True, 2, None, 4 * (2 + 4) + 2 * (2 + 1)),  # writer 0 read by layers 1, 2; writer 1 by layer 2
    (3, False, 2, None, 4 * (1 + 2) + 2 * (2 + 1)),
    (3, True, 2, 1, 4 * (2 + 2) + 2 * (1 + 1)),  # window 1: each layer reads only the previous layer's two entries
])
def test_depth_pool_bytes_match_hand_count(layers, ffn_kv, kv_heads, window, slots):
    script = _load_script()
    batch, seq, head_dim = 3, 5, 64
    reads = script.depth_pool_reads(_config(layers, ffn_kv, kv_heads, window), batch, seq)
    slot = batch * seq * kv_heads * head_dim * 4
    assert sum(r.nbytes for r in reads) == slots * slot
    assert all(r.nbytes > 0 and r.nbytes % slot == 0 for r in reads)


def test_in_situ_model_is_llama_plus_the_projection():
    """``llama+ffnkv`` computes Llama's loss exactly and runs the projection's backward (its weights get gradients)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    script = _load_script()
    config = LlamaConfig(num_hidden_layers=3, hidden_size=128, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    llama = LlamaForCausalLM(config)
    model = script.with_depth_projection(LlamaForCausalLM(config))
    state = {k.replace(".mlp.mlp.", ".mlp."): v for k, v in model.state_dict().items() if "ffn_kv_proj" not in k}
    llama.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.equal(loss, llama(input_ids=ids, labels=ids).loss)  # same kernels, same order: identical
    projections = {n: p for n, p in model.named_parameters() if "ffn_kv_proj" in n}
    assert len(projections) == 2  # every layer but the last, as in MoDA
    assert all(p.shape == (2 * 1 * 64, 128) and p.grad is not None for p in projections.values())


def test_rejects_unsupported_sizes():
    script = _load_script()
    with pytest.raises(SystemExit):
        script.parse_args(["--hidden", "100"])
    with pytest.raises(SystemExit):
        script.parse_args(["--layers", "1"])


def test_toy_run_prints_table_and_appends_record(tmp_path):
    out = tmp_path / "floor.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPTHFUSION")}
    env["OMP_NUM_THREADS"] = "1"
    args = ["--layers", "2", "--hidden", "128", "--kv-heads", "1", "--intermediate", "64", "--vocab", "64",
            "--seq", "8", "--batch", "2", "--reps", "1", "--decode-steps", "2", "--cache", "4", "--prompt", "4",
            "--generate-tokens", "2", "--evict-mib", "1", "--label", "toy", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "floor strict" in proc.stdout and "verdict" in proc.stdout

    lines = out.read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    for field in ("date", "machine", "command", "commit", "torch", "label", "args", "results"):
        assert field in record, field
    assert record["label"] == "toy" and "--reps 1" in record["command"]
    results = record["results"]

    slot = 2 * 8 * 1 * 64 * 4  # B T Hkv d * 4 bytes; G = 2
    floors = results["floors"]
    assert floors["moda"]["bytes"] == (4 * 2 + 2 * 2 * 1) * slot
    assert floors["moda-noffn"]["bytes"] == (4 * 1 + 2 * 2 * 1) * slot
    for name, floor in floors.items():
        assert floor["depth_flops_train"] > 0 and floor["train_floor_in_situ"]["median"] > 0
        for cache in ("hot", "cold"):
            assert floor[f"memory_s_{cache}"]["min"] > 0, name
            assert floor[f"memory_ratio_{cache}"]["min"] > 0, name
            assert floor[f"train_floor_{cache}"]["min"] > 1, name
            ceiling = floor[f"decode_ceiling_{cache}"]["median"]
            if name == "moda":
                assert floor[f"projection_ratio_{cache}"]["min"] > 0
                assert 0 < ceiling < 1
            else:
                assert floor[f"projection_ratio_{cache}"]["max"] == 0
                assert ceiling == 1
    moda = floors["moda"]
    assert moda["projection_gemm_flops"] == 3 * 2 * (2 * 8) * (2 * 1 * 64 * 128) * 1  # 3 GEMMs, 1 projection
    assert moda["projection_weight_bytes"] == 2 * 1 * 64 * 128 * 4
    assert 0 < moda["decode_ceiling_bytes"]["median"] < 1
    for name in ("llama-control", "moda", "moda-noffn", "llama+ffnkv"):
        for metric in ("train", "decode_step", "decode_generate"):
            assert results["measured"][name][metric]["median"] > 0, (name, metric)

    rows = {(r["model"], r["metric"]): r for r in results["verdicts"]}
    assert set(rows) == {(m, k) for m in ("moda", "moda-noffn") for k in ("train", "decode")}
    assert rows["moda", "train"]["target"] == 1.15 and rows["moda-noffn", "train"]["target"] == 1.06
    assert rows["moda", "decode"]["target"] == 0.90
    for row in rows.values():
        assert row["floor_strict"] > 0 and row["floor_cold"] > 0 and row["floor_in_situ"] > 0 and row["measured"] > 0
        if row["metric"] == "train":
            assert row["target_below_floor_strict"] == (row["target"] < row["floor_strict"])
        else:
            assert row["target_below_floor_strict"] == (row["target"] > row["floor_strict"])
