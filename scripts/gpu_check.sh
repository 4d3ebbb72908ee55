#!/usr/bin/env bash
# GPU check for issue 5: on a CUDA machine, run the kernel tests (compiled, not interpreted) and the
# benchmarks, in under 10 minutes, writing everything to one folder.
#
#   scripts/gpu_check.sh [OUT_DIR]        # default OUT_DIR: gpu_results/
#
# Each step runs under its own time limit; a failing step is recorded and the next one still runs.
# OUT_DIR gets one log per step, the benchmarks' JSONL records (bench_*.jsonl, same format as
# docs/bench/*.jsonl: append them there), machine.txt, and summary.txt (step, status, seconds).
# Exit status: 0 when every step passed, 1 otherwise.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${1:-gpu_results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET DEPTHFUSION_BACKEND || true

SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
START_ALL=$(date +%s)

# step NAME LIMIT_SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, never abort the script.
step() {
  local name=$1 limit=$2
  shift 2
  local t0 rc status
  t0=$(date +%s)
  echo "=== [$name] (limit ${limit}s): $*"
  set +e
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  set -e
  local dt=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 0 ]; then status=ok; elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=TIMEOUT; else status="FAILED(rc=$rc)"; fi
  [ "$rc" -eq 0 ] || FAILED=1
  printf '%-22s %-14s %5ss\n' "$name" "$status" "$dt" | tee -a "$SUMMARY"
  tail -n 25 "$OUT/$name.log" | sed 's/^/    /'
}

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  echo "host: $(hostname)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: unavailable"
  "$PY" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); sys.exit(0)"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 || true
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: this script is for GPU machines (CPU runs: pytest -q; scripts/bench_*.py)" | tee -a "$SUMMARY"
  exit 1
fi

# 1. Kernel tests on CUDA: the Triton kernels compiled for the device, against the references.
step kernel_tests 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels
# 1b. CUDA-only behaviour (token-id checks without a host sync).
step cuda_tests 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/cuda
# 2. DWA: whole-depth forward+backward vs the paper's accumulator+tensordot, and bandwidth vs copy.
step bench_dwa 100 "$PY" scripts/bench_dwa.py --device cuda --dtype bf16 --reps 10 --out "$OUT/bench_dwa.jsonl"
# 3. Models: training step, peak memory and decode tokens/s against LlamaForCausalLM.
step bench_models 100 "$PY" scripts/bench_models.py --device cuda --dtype bf16 --batch 16 --reps 10 \
  --decode-reps 3 --out "$OUT/bench_models.jsonl"
# 4. MoDA attention vs SDPA at long T (written by the MoDA-kernel engineer).
step bench_moda_attention 100 "$PY" scripts/bench_moda_attention.py --device cuda --dtype bf16 \
  --out "$OUT/bench_moda_attention.jsonl"
# 5. AttnRes op: the fused kernel against the plain residual sum, and its bandwidth.
step bench_attnres 100 "$PY" scripts/bench_attnres.py --device cuda --dtype bf16 --out "$OUT/bench_attnres.jsonl"

TOTAL=$(( $(date +%s) - START_ALL ))
echo "total ${TOTAL}s" | tee -a "$SUMMARY"
echo "results in $OUT"
exit "$FAILED"
