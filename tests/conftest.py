"""Test-wide settings: offline Hub, a private HF_HOME, deterministic seeds."""

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
