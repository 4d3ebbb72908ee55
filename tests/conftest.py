"""Test-wide settings: offline Hub, a private HF_HOME, deterministic seeds, one torch thread per pytest-xdist worker."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ["HF_HOME"] = os.environ.get("DEPTHFUSION_TEST_HF_HOME") or tempfile.mkdtemp(prefix="hf_home_")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """The workers of ``-n auto`` (pyproject.toml's addopts): two (CI's and the development machine's 2 cores); none in
    a pytest that a test started (``tests/kernels/interpret.py``'s child), which runs in one process as before."""
    return 0 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def pytest_configure(config):
    """Under pytest-xdist (``-n auto`` in pyproject.toml's addopts) the workers share the cores: each runs one torch
    intra-op thread, and the processes its tests start one OpenMP thread unless ``OMP_NUM_THREADS`` says otherwise."""
    if hasattr(config, "workerinput"):
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
