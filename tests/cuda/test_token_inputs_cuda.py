"""On CUDA the decoder families check token ids without a host sync per forward, and still refuse bad ids."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():  # also when named on the command line (conftest's collect_ignore is not then)
    pytest.skip("needs a CUDA device", allow_module_level=True)

from depthfusion_hf.models.depthfusion_common import check_token_inputs  # noqa: E402

BAD_IDS_SCRIPT = """
import torch
from depthfusion_hf.models.depthfusion_common import check_token_inputs
check_token_inputs(torch.tensor([[3, 97]], device="cuda"), None, 97)
torch.cuda.synchronize()
"""


def test_valid_ids_are_checked_without_a_host_sync():
    ids = torch.tensor([[3, 5, 96]], device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call below raises
    try:
        check_token_inputs(ids, None, 97)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_an_out_of_range_id_fails_at_the_next_sync():
    # A device-side assertion poisons the CUDA context, so it runs in its own process. Whether CUDA reports our
    # message or its generic device-side-assert text depends on the build; either way the run stops.
    proc = subprocess.run([sys.executable, "-c", BAD_IDS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "RuntimeError" in proc.stderr, proc.stderr[-2000:]
    assert "input_ids must lie in [0, vocab_size=97)" in proc.stderr or "device-side assert" in proc.stderr


def test_bad_shapes_and_dtypes_are_still_refused_eagerly():
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        check_token_inputs(torch.ones(1, 2, device="cuda"), None, 97)
