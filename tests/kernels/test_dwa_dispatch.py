"""Backend selection for ``depth_weighted_average``: argument, environment variable, automatic."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from depthfusion_hf.models import dwa
from depthfusion_hf.models.dwa import BACKEND_ENV_VAR, depth_weighted_average, resolve_backend

CPU = torch.device("cpu")


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)


def _spy(monkeypatch) -> list[str]:
    """Record which implementation ``depth_weighted_average`` calls."""
    calls: list[str] = []
    ref, tor = dwa.dwa_reference, dwa.dwa_torch
    monkeypatch.setattr(dwa, "dwa_reference", lambda s, w, d: calls.append("reference") or ref(s, w, d))
    monkeypatch.setattr(dwa, "dwa_torch", lambda s, w, d: calls.append("torch") or tor(s, w, d))
    monkeypatch.setattr(dwa, "triton_depth_weighted_average", lambda s, w, d: calls.append("triton") or tor(s, w, d))
    return calls


def test_auto_picks_torch_on_cpu(no_env, monkeypatch):
    calls = _spy(monkeypatch)
    assert resolve_backend(None, CPU) == "torch"
    assert resolve_backend("auto", CPU) == "torch"
    # Even when the kernel is available (interpreted), CPU tensors go to the PyTorch path.
    monkeypatch.setattr(dwa, "dwa_triton_forward_backward_available", lambda: True)
    assert resolve_backend("AUTO", CPU) == "torch"
    depth_weighted_average([torch.ones(3)], torch.ones(1))
    assert calls == ["torch"]


def test_auto_picks_triton_for_cuda_when_available(no_env, monkeypatch):
    monkeypatch.setattr(dwa, "dwa_triton_forward_backward_available", lambda: True)
    assert resolve_backend(None, torch.device("cuda")) == "triton"
    monkeypatch.setattr(dwa, "dwa_triton_forward_backward_available", lambda: False)
    assert resolve_backend(None, torch.device("cuda")) == "torch"


@pytest.mark.parametrize("backend", ["reference", "torch", "Torch"])
def test_backend_argument_is_used(backend, no_env, monkeypatch):
    calls = _spy(monkeypatch)
    x, w = [torch.randn(4), torch.randn(4)], torch.randn(2)
    y = depth_weighted_average(x, w, backend=backend)
    assert calls == [backend.lower()]
    torch.testing.assert_close(y, w[0] * x[0] + w[1] * x[1])


def test_environment_variable_forces_backend(monkeypatch):
    calls = _spy(monkeypatch)
    monkeypatch.setenv(BACKEND_ENV_VAR, "reference")
    depth_weighted_average([torch.randn(4)], torch.randn(1))
    assert calls == ["reference"]
    # An explicit argument wins over the environment.
    depth_weighted_average([torch.randn(4)], torch.randn(1), backend="torch")
    assert calls == ["reference", "torch"]
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    monkeypatch.setattr(dwa, "dwa_triton_forward_backward_available", lambda: True)
    monkeypatch.setattr(dwa, "dwa_triton_runs_on", lambda device: True)
    depth_weighted_average([torch.randn(4)], torch.randn(1))
    assert calls[-1] == "triton"


def test_triton_on_a_device_it_cannot_run_on(no_env, monkeypatch):
    """Triton available (a CUDA machine) but CPU tensors without the interpreter: a clear error, no crash."""
    monkeypatch.setattr(dwa, "dwa_triton_forward_backward_available", lambda: True)
    monkeypatch.setattr(dwa, "dwa_triton_runs_on", lambda device: device.type == "cuda")
    with pytest.raises(ValueError, match="runs on CUDA tensors.*got device cpu"):
        depth_weighted_average([torch.randn(4)], torch.randn(1), backend="triton")
    assert resolve_backend(None, CPU) == "torch"


def test_float64_on_the_triton_backend_takes_the_torch_path(no_env, monkeypatch):
    """The dispatcher, not the kernel, routes float64 (which the kernel does not compute) to PyTorch."""
    calls = _spy(monkeypatch)
    monkeypatch.setattr(dwa, "dwa_triton_forward_backward_available", lambda: True)
    monkeypatch.setattr(dwa, "dwa_triton_runs_on", lambda device: True)
    x, w = [torch.randn(5, dtype=torch.float64) for _ in range(2)], torch.randn(2, dtype=torch.float64)
    y = depth_weighted_average(x, w, backend="triton")
    assert calls == ["torch"]
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, w[0] * x[0] + w[1] * x[1], rtol=1e-15, atol=1e-15)
    depth_weighted_average([t.float() for t in x], w.float(), backend="triton")
    assert calls == ["torch", "triton"]


def test_unknown_backend_names_the_allowed_values(no_env, monkeypatch):
    with pytest.raises(ValueError) as err:
        depth_weighted_average([torch.randn(4)], torch.randn(1), backend="cuda")
    for allowed in ("auto", "reference", "torch", "triton", "'cuda'"):
        assert allowed in str(err.value)
    monkeypatch.setenv(BACKEND_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="'fast'"):
        depth_weighted_average([torch.randn(4)], torch.randn(1))


def test_triton_requested_but_unavailable(no_env, monkeypatch):
    monkeypatch.setattr(dwa, "dwa_triton_forward_backward_available", lambda: False)
    with pytest.raises(ValueError, match="backend='triton'.*not available"):
        depth_weighted_average([torch.randn(4)], torch.randn(1), backend="triton")
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    with pytest.raises(ValueError, match="not available"):
        depth_weighted_average([torch.randn(4)], torch.randn(1))


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="availability is genuinely True here")
def test_availability_false_on_cpu_without_interpreter():
    from depthfusion_hf.models import dwa_triton

    assert dwa_triton.dwa_triton_forward_backward_available() is False
    with pytest.raises(ValueError, match="not available"):
        depth_weighted_average([torch.randn(4)], torch.randn(1), backend="triton")


@pytest.mark.integration
def test_works_without_triton_installed(tmp_path):
    """With Triton unimportable, the kernel module still imports, reports unavailable, and DWA runs."""
    code = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError("No module named 'triton' (blocked by the test)")
sys.meta_path.insert(0, _Block())
import torch
from depthfusion_hf.models import dwa, dwa_triton
assert dwa_triton.triton is None and not dwa_triton.dwa_triton_forward_backward_available()
assert dwa.triton_depth_weighted_average is dwa_triton.triton_depth_weighted_average
y = dwa.depth_weighted_average([torch.ones(3), 2 * torch.ones(3)], torch.tensor([1.0, 0.5]))
assert torch.equal(y, 2 * torch.ones(3)), y
try:
    dwa.depth_weighted_average([torch.ones(3)], torch.ones(1), backend="triton")
except ValueError as e:
    assert "not available" in str(e)
else:
    raise AssertionError("no ValueError")
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", BACKEND_ENV_VAR)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_precedence_argument_environment_config(monkeypatch):
    """argument > $DEPTHFUSION_BACKEND > the config's op_backend > automatic."""
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    assert resolve_backend(None, CPU, "reference") == "reference"
    assert resolve_backend(None, CPU, "auto") == "torch"
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    assert resolve_backend(None, CPU, "reference") == "torch"
    assert resolve_backend("reference", CPU, "torch") == "reference"


def test_model_uses_config_op_backend(no_env, monkeypatch):
    """A DenseFormer whose config says op_backend='reference' runs every DWA step on the reference."""
    from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM

    calls = _spy(monkeypatch)
    config = DenseFormerConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                               vocab_size=20, op_backend="reference")
    DenseFormerForCausalLM(config)(torch.tensor([[1, 2, 3]]))
    assert calls == ["reference", "reference"]
    config.op_backend = "torch"
    calls.clear()
    DenseFormerForCausalLM(config)(torch.tensor([[1, 2, 3]]))
    assert calls == ["torch", "torch"]
