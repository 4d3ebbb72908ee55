"""The op benchmarks (``benchmarks/bench_dwa.py``, ``bench_attnres.py``, ``bench_moda_attention.py``) at a toy size:
each runs its implementations interleaved and writes one record with the paired ratios against its baseline. No
timing thresholds: the records are checked for their structure and arithmetic."""

import json

import pytest

from .test_bench_models import load_benchmark


def read_one(path):
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    for key in ("date", "machine", "load", "torch", "commit", "package_commit", "command", "results"):
        assert key in record, key
    assert record["load_at_start"]["cpus"] == record["load"]["cpus"]
    return record


def check_ratios(ratios: dict, base: str, reps: int) -> None:
    assert ratios[base]["values"] == [1.0] * reps
    for spread in ratios.values():
        values = sorted(spread["values"])
        assert len(values) == reps and spread["min"] == values[0] and spread["max"] == values[-1]
        assert spread["median"] == pytest.approx((values[(reps - 1) // 2] + values[reps // 2]) / 2, rel=1e-12)


def test_bench_dwa_toy(tmp_path):
    out = tmp_path / "dwa.jsonl"
    load_benchmark("bench_dwa").main(["--shape", "1,4,8", "--depths", "3,5", "--configs", "1x1,2x3", "--reps", "2",
                                      "--out", str(out)])
    record = read_one(out)
    assert [(r["depth"], r["config"]) for r in record["results"]] == [(3, "1x1"), (5, "1x1"), (3, "2x3"), (5, "2x3")]
    for row in record["results"]:
        assert set(row["time_ms"]) == {"none", "paper", "reference", "torch"}
        check_ratios(row["ratio_vs_paper"], "paper", 2)
        assert row["dwa_ms"]["torch"] == pytest.approx(row["time_ms"]["torch"] - row["time_ms"]["none"], rel=1e-12)


def test_bench_attnres_toy(tmp_path):
    out = tmp_path / "attnres.jsonl"
    load_benchmark("bench_attnres").main(["--tokens", "8", "--dim", "8", "--sources", "2", "3", "--reps", "3",
                                          "--out", str(out)])
    record = read_one(out)
    assert [(r["N"], r["mode"]) for r in record["results"]] == [(2, "fwd"), (2, "fwd+bwd"), (3, "fwd"), (3, "fwd+bwd")]
    for row in record["results"]:
        assert set(row["time_ms"]) == {"sum", "reference", "torch"}
        check_ratios(row["ratio_vs_sum"], "sum", 3)


def test_bench_moda_attention_toy(tmp_path):
    out = tmp_path / "moda_attention.jsonl"
    load_benchmark("bench_moda_attention").main(["--T", "8", "--L", "0", "2", "--hq", "2", "--hkv", "1",
                                                 "--head-dim", "8", "--reps", "2", "--out", str(out)])
    record = read_one(out)
    assert record["sanity"]["torch"] < 1e-5  # no depth entries: MoDA is causal attention
    assert [(r["L"], r["M"], r["mode"]) for r in record["results"]] == [
        (0, 0, "fwd"), (0, 0, "fwd+bwd"), (2, 4, "fwd"), (2, 4, "fwd+bwd")]
    for row in record["results"]:
        check_ratios(row["ratio_vs_sdpa"], "sdpa", 2)
