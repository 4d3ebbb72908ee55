"""DWAtt tests run torch on one thread: on a shared 2-core CPU, two threads per process oversubscribe the
cores and tiny models slow down ~10x (measured: 80 tiny training steps, 28 s on 2 threads vs 2 s on 1)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
