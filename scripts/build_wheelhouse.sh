#!/usr/bin/env bash
# Build the wheelhouse that scripts/gpu_check.sh installs offline on the project's H200 machine.
#
#   scripts/build_wheelhouse.sh [DIR]        # default DIR: .whl/ (ignored by git; named in the run's `carry`)
#
# That machine has no network; its python3 holds torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0,
# huggingface_hub 1.33, tokenizers 0.23.2, safetensors 0.8.0, accelerate 1.15, typer, numpy, pyyaml, matplotlib
# (docs/BENCHMARKS.md, "GPU check"). transformers 5.17 is below our lower bound, so the house carries
# transformers 5.24.0 and what its import-time version check needs that the machine may lack (regex >=
# 2025.10.22). Never torch or triton: the machine's own CUDA builds are what the check tests.
#
# Wheels are fetched for CPython 3.12 on x86-64 manylinux (the machine's interpreter), whatever this machine
# runs. Only files this script downloads are added; an existing DIR is kept, and two versions of one
# distribution in it stop the script (pip would refuse the install there) instead of being deleted.
set -euo pipefail

cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
MAX_MIB=60
# name==version, one per line: the versions CI tests with (.venv), so the device runs the same code.
WHEELS=(
  "transformers==5.24.0"
  "regex==2026.11.19"
  # the check's cuda_tests step runs pytest, which is not in that machine's known packages
  "pytest==9.2.0"
  "pluggy==1.7.0"
  "iniconfig==2.3.1"
  "pygments==2.21.0"
)

mkdir -p "$DIR"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
for spec in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$DIR" "$spec"
done

# One version per distribution (wheel names: {name}-{version}-...; names normalised as pip does).
dupes=$(for f in "$DIR"/*.whl; do basename "$f" | cut -d- -f1 | tr 'A-Z.-' 'a-z__'; done | sort | uniq -d)
if [ -n "$dupes" ]; then
  echo "error: $DIR holds two versions of: $dupes (remove the one you do not want; pip installs only one)" >&2
  exit 1
fi
size_kib=$(du -sk "$DIR" | cut -f1)
if [ "$size_kib" -gt $((MAX_MIB * 1024)) ]; then
  echo "error: $DIR is $((size_kib / 1024)) MiB, over the ${MAX_MIB} MiB the device run may carry" >&2
  exit 1
fi
echo "wheelhouse $DIR ($((size_kib / 1024)) MiB):"
ls -1 "$DIR"
