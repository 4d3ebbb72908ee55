#!/usr/bin/env bash
# The GPU check (issues 20, 21): on a CUDA machine as it is, with no network, in at most about 7.5 minutes
# (set-up, then the steps within a 420-second budget).
#
#   scripts/gpu_check.sh OUT        # OUT: a folder for gpu_check.json (kept current after every step) and gpu_check.log
#
# Set-up: the wheels in $WHEELHOUSE (default .whl/, made by scripts/build_wheelhouse.sh: transformers 5.24 and what
# the machine lacks, never torch or triton) are installed offline into a fresh folder (pip --no-index --no-deps
# --target) that goes first on PYTHONPATH, with this checkout's src/; the machine's own CUDA torch and Triton stay.
# Then scripts/gpu_check.py runs the steps (env, aot, ops, cuda_tests, models, decode, speed), most important first,
# each in its own process under its own time limit, within $GPU_CHECK_BUDGET seconds (default 420).
# $PYTHON picks the interpreter (default python3, the H200 machine's CUDA one).
# Exit status: 0 when every step passed, 1 when one did not, 2 without a CUDA device (only `env` runs).
set -uo pipefail

cd "$(dirname "$0")/.."
if [ $# -ne 1 ]; then
  echo "usage: scripts/gpu_check.sh OUT" >&2
  exit 64
fi
OUT=$1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
WHEELHOUSE=${WHEELHOUSE:-.whl}
unset TRITON_INTERPRET DEPTHFUSION_BACKEND
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}

SITE=$(mktemp -d "${TMPDIR:-/tmp}/depthfusion-gpu-site.XXXXXX")
trap 'rm -rf "$SITE"' EXIT  # the folder this script made, nothing else
wheels=()
if [ -d "$WHEELHOUSE" ]; then
  for w in "$WHEELHOUSE"/*.whl; do [ -e "$w" ] && wheels+=("$w"); done
fi
setup_status=ok
if [ ${#wheels[@]} -gt 0 ]; then
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$SITE" "${wheels[@]}" > "$OUT/gpu_check.log" 2>&1; then
    setup_status="pip install failed (see gpu_check.log)"
  fi
else
  setup_status="no wheels in $WHEELHOUSE: the machine's own packages are used (run scripts/build_wheelhouse.sh)"
  : > "$OUT/gpu_check.log"
fi
export PYTHONPATH="$SITE:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_SITE="$SITE"  # the env step checks that what was installed there is what imports
names=""
for w in "${wheels[@]}"; do names="$names\"$(basename "$w")\","; done
setup="{\"status\": \"$setup_status\", \"python\": \"$PY\", \"site\": \"$SITE\", \"wheels\": [${names%,}]}"
echo "set-up: $setup"

"$PY" scripts/gpu_check.py --out "$OUT" --budget "${GPU_CHECK_BUDGET:-420}" --setup "$setup"
