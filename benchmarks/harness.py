"""The shared benchmark harness: clocks, peak memory, machine, commit, another checkout's family folders."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> Callable[[], float]:
    """The timer: process CPU time on CPU (steady when other jobs share the cores), wall time on CUDA."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated during ``fn()`` above what was allocated before it.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the profiler's allocation trace (running total
    of every allocation and free, read from a Chrome trace, in time order).
    """
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0),
                 key=lambda e: e["ts"])
    current = peak = 0
    for e in mem:
        current += e["args"]["Bytes"]
        peak = max(peak, current)
    return peak


def machine_name(device: torch.device) -> str:
    """e.g. ``"NVIDIA H100 80GB HBM3 @ host"`` or ``"AMD EPYC (2 threads) @ host"``."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        name = f"{name} ({torch.get_num_threads()} threads)"
    return f"{name} @ {platform.node()}"


def git_commit() -> str:
    """The short commit id of the checkout, or ``"unknown"``."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


def load_family_folder(folder: Path, family: str, name: str):
    """Import a self-contained ``models/<family>`` folder (e.g. of an older checkout) as the package ``name``.

    ``folder`` is the family folder itself or a checkout (its ``src/depthfusion_hf/models/<family>`` is used),
    so an old and a new version of the same family can be timed side by side in one process.
    """
    if (folder / "src").is_dir():
        folder = folder / "src" / "depthfusion_hf" / "models" / family
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
