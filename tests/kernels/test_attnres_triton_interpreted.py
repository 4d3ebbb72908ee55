"""Plain CPU runs: execute the Triton AttnRes tests in a child process under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kernels.interpret import needs_child_process, run_interpreted


@pytest.mark.integration
@pytest.mark.skipif(not needs_child_process(), reason="kernel tests already run in this process (CUDA/interpreted)")
def test_triton_attnres_kernels_interpreted():
    out = run_interpreted(Path(__file__).with_name("test_attnres_triton.py"))
    assert "skipped" not in out.splitlines()[-1], out[-2000:]
