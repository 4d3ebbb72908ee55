"""Settings for transformers' common tests and our generation tests."""

import pytest
import torch

# The markers transformers' test files use (its own pytest configuration registers them; ours must, or every use
# warns). They only group tests upstream; nothing here selects by them.
UPSTREAM_MARKERS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                    "torch_compile_test", "generate", "slow")


def pytest_configure(config):
    for marker in UPSTREAM_MARKERS:
        config.addinivalue_line("markers", f"{marker}: a group of transformers' own tests (upstream marker)")


@pytest.fixture(autouse=True, scope="package")
def _one_intra_op_thread():
    """One intra-op thread while this folder runs: its tensors are tiny, and on a loaded 2-core machine the second
    thread's spin-waits cost about 6x the process CPU time of the work (Llama's common suite: 37.5 s -> 6.3 s).
    The previous count is restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
