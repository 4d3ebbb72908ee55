"""The mHC Triton kernels compile ahead of time for A100 (sm_80) and H100 / H200 (sm_90) without a GPU: every
specialisation the ops launch (``mhc_aot_cases.py``: fp32 / bf16 / fp16, n = 1, 3, 4, 8, training and decoding shapes,
forward and backward) compiles, fits the target's shared memory and spills no register, in any dtype."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_every_mhc_kernel_compiles_for_sm80_and_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.mhc_aot_cases"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kernels = {row["kernel"] for row in rows}
    assert kernels == {"hc_project_kernel", "hc_weights_kernel", "hc_weights_bwd_kernel", "hc_input_bwd_kernel",
                       "hc_fn_bwd_kernel", "mix_fwd_kernel", "mix_bwd_kernel"}, kernels
    assert {row["target"] for row in rows} == {"sm_80", "sm_90"}
    bad = [row for row in rows if row["problems"] or row["spill_stores"] or row["spill_loads"]]
    assert not bad, "\n".join(f"{r['target']} {r['specialisation']}: {r['problems']} spills "
                              f"{r['spill_stores']}/{r['spill_loads']} B" for r in bad)
