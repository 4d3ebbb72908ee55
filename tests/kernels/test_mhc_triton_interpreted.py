"""Plain CPU runs: execute the Triton mHC tests in a child process under ``TRITON_INTERPRET=1``."""

from pathlib import Path

import pytest

from tests.kernels.interpret import needs_child_process, run_interpreted


@pytest.mark.skipif(not needs_child_process(), reason="the kernel tests already run in this process (CUDA/interpreted)")
def test_triton_mhc_kernels_interpreted():
    out = run_interpreted(Path(__file__).with_name("test_mhc_triton.py"), timeout=900)
    assert "skipped" not in out.splitlines()[-1], out[-2000:]
