"""``benchmarks/bench_serving.py`` runs end to end at a tiny shape in the vLLM venv: every worker starts, vLLM's tokens
equal HF ``generate``'s (the script stops otherwise), the table and the profiles are printed and one record is
appended with every model's figures. No timing is checked."""

import json
import subprocess
import sys

from tests.examples.test_examples import ROOT

TINY = ["--models", "mhc", "--layers", "2", "--hidden", "64", "--intermediate", "128", "--vocab", "128", "--batch",
        "2", "--prompt-len", "4", "--new-tokens", "4", "--repeats", "1", "--warmup", "0", "--profile", "always"]


def test_bench_serving_runs_and_records(tmp_path):
    out = tmp_path / "serving.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"), *TINY, "--out", str(out),
                           "--label", "smoke"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| llama |") or line.startswith("| mhc |")]
    assert len(rows) == 2, proc.stdout[-3000:]
    assert "## profile of one vLLM call: mhc" in proc.stdout
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["label"] == "smoke" and record["mode"] == "eager" and record["new_tokens"] == 4
    assert set(record["models"]) == {"llama", "mhc"}
    mhc = record["models"]["mhc"]
    assert len(mhc["vllm_tok_s"]["values"]) == len(mhc["hf_tok_s"]["values"]) == 1
    assert mhc["vllm_over_llama"]["median"] > 0 and isinstance(mhc["meets_bound"], bool)
    assert set(record["profiles"]) == {"llama", "mhc"}
