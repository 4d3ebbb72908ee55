"""Run a kernel test module under ``TRITON_INTERPRET=1`` in a fresh pytest process.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` module is imported, and the main test
process has already imported the kernels (``depthfusion_hf`` imports them on first use), so a CPU
run checks the kernels in a child process. Reusable by any ``tests/kernels`` module:

    from tests.kernels.interpret import needs_child_process, run_interpreted
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def kernels_run_in_process() -> bool:
    """True when kernel tests can run in this process: on CUDA, or already interpreted."""
    return os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


def needs_child_process() -> bool:
    """True when the kernel tests must run in an interpreted child (no CUDA, not interpreted here)."""
    return not kernels_run_in_process()


def run_interpreted(test_file: str | Path, timeout: int = 300, extra_args: tuple[str, ...] = ()) -> str:
    """Run ``pytest -q test_file`` with ``TRITON_INTERPRET=1`` in a child process; return its output.

    Raises AssertionError with the child's output tail when a test fails or none ran.
    """
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("DEPTHFUSION_BACKEND", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file),
           *extra_args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"interpreted kernel tests failed (rc={proc.returncode}):\n{out[-6000:]}")
    if " passed" not in out:
        raise AssertionError(f"interpreted kernel tests ran nothing:\n{out[-3000:]}")
    return out
