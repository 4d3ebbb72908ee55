"""Plain CPU runs: execute the Triton DWA tests in a child process under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kernels.interpret import needs_child_process, run_interpreted


@pytest.mark.integration
@pytest.mark.skipif(not needs_child_process(), reason="kernel tests already run in this process (CUDA/interpreted)")
def test_triton_dwa_kernels_interpreted():
    """The op's kernel tests and the model-level ones (a DenseFormer on the kernel), in one child process."""
    here = Path(__file__).parent
    out = run_interpreted(here / "test_dwa_triton.py", extra_args=(str(here / "test_dwa_model_triton.py"),))
    assert "skipped" not in out.splitlines()[-1], out[-2000:]
