#!/usr/bin/env bash
# A second virtual environment with the oldest transformers this package supports (pyproject.toml's floor, 5.16.1:
# the floor of vLLM's pins), for CI's old-transformers leg (.ci/run): torch (CPU build 2.13.0) first, then this
# package with its dev extras, transformers held at the old version. Safe to re-run; it only installs what is missing.
# Usage: bash scripts/setup_old_transformers.sh [VENV]   (default: .venv-oldest in the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-oldest}
OLD_TRANSFORMERS=${OLD_TRANSFORMERS:-5.16.1}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
# Held in the same resolve: pip must satisfy the package's own bounds with this transformers (no upgrade).
"$VENV/bin/python" -m pip install -q -e ".[dev]" "transformers==$OLD_TRANSFORMERS"
"$VENV/bin/python" - "$OLD_TRANSFORMERS" <<'EOF'
import sys

import transformers

import depthfusion_hf  # noqa: F401  (imports under the old transformers)

if transformers.__version__ != sys.argv[1]:
    sys.exit(f"setup_old_transformers.sh: wanted transformers {sys.argv[1]}, got {transformers.__version__}")
print(f"setup_old_transformers.sh: transformers {transformers.__version__} in {sys.prefix}")
EOF
