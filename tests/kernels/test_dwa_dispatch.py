"""The DWA dispatcher's routing of work the kernels do not compute. Which backend runs (argument, environment,
config, automatic) is tested for every op in ``tests/test_backend_choice.py``."""

from __future__ import annotations

import torch

from depthfusion_hf.models import depthfusion_common, dwa
from depthfusion_hf.models.dwa import depth_weighted_average


def test_float64_on_the_triton_backend_takes_the_torch_path(monkeypatch):
    """The dispatcher, not the kernel, routes float64 (which the kernel does not compute) to PyTorch."""
    calls: list[str] = []
    torch_path = dwa.dwa_torch
    monkeypatch.setattr(dwa, "dwa_torch", lambda s, w, d: calls.append("torch") or torch_path(s, w, d))
    monkeypatch.setattr(dwa, "triton_depth_weighted_average",
                        lambda s, w, d: calls.append("triton") or torch_path(s, w, d))
    monkeypatch.setattr(depthfusion_common, "triton_available", lambda: True)
    monkeypatch.setattr(depthfusion_common, "triton_runs_on", lambda device: True)
    x, w = [torch.randn(5, dtype=torch.float64) for _ in range(2)], torch.randn(2, dtype=torch.float64)
    y = depth_weighted_average(x, w, backend="triton")
    assert calls == ["torch"]
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, w[0] * x[0] + w[1] * x[1], rtol=1e-15, atol=1e-15)
    depth_weighted_average([t.float() for t in x], w.float(), backend="triton")
    assert calls == ["torch", "triton"]
