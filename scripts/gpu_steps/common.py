"""What every GPU-check step shares: its result file (rewritten as it goes), checks with dtype-derived tolerances,
CUDA timing.

A step is ``python scripts/gpu_steps/<name>.py --result FILE --work DIR``; it records into FILE through
:class:`Result` after every check, so a step killed at its time limit still reports what it finished. The
dispatcher (``scripts/gpu_check.py``) merges FILE into ``$OUT/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The steps run on CUDA. A smoke run of their code on this CPU machine (tests/cuda/test_gpu_check.py) sets
# GPU_CHECK_DEVICE=cpu, GPU_CHECK_SMOKE=1 (toy shapes: see size()) and TRITON_INTERPRET=1 (kernels interpreted).
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
SMOKE = os.environ.get("GPU_CHECK_SMOKE") == "1"


def size(real, smoke):
    """``real`` on the GPU, ``smoke`` in a smoke run (toy shapes that exercise the same code)."""
    return smoke if SMOKE else real

# Unit roundoff of each compute dtype (half the distance from 1 to the next number).
UNIT_ROUNDOFF = {"torch.float64": 2.0**-53, "torch.float32": 2.0**-24, "torch.bfloat16": 2.0**-8,
                 "torch.float16": 2.0**-11}


class Result:
    """A step's result: ``checks`` (each ``ok`` or not), ``measurements``, ``notes``; on disk after every change."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.data: dict = {"checks": [], "measurements": [], "notes": {}}
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    def check(self, name: str, ok: bool, **details) -> bool:
        self.data["checks"].append({"name": name, "ok": bool(ok), **details})
        self.flush()
        print(f"[{'ok' if ok else 'FAILED'}] {name} {json.dumps(details, default=str)[:400]}", flush=True)
        return bool(ok)

    def measure(self, name: str, **values) -> None:
        self.data["measurements"].append({"name": name, **values})
        self.flush()
        print(f"[measured] {name} {json.dumps(values, default=str)[:400]}", flush=True)

    def note(self, key: str, value) -> None:
        self.data["notes"][key] = value
        self.flush()

    def attempt(self, name: str, fn: Callable[[], None]) -> None:
        """Run one sub-check; an exception becomes a failed check with its message (the next sub-check still runs)."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported, and the step goes on
            self.check(name, False, error=f"{type(exc).__name__}: {exc}"[:3000],
                       traceback=traceback.format_exc()[-3000:])
        finally:
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - best effort
                pass


def step_main(run: Callable[[Result, argparse.Namespace], None]) -> None:
    """The command line of a step: ``--result FILE --work DIR``; an uncaught exception is recorded as ``error``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", required=True)
    parser.add_argument("--work", required=True, help="a scratch folder the dispatcher made for this run")
    args = parser.parse_args()
    result = Result(args.result)
    try:
        run(result, args)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        result.data["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        result.data["traceback"] = traceback.format_exc()[-4000:]
        result.flush()
        traceback.print_exc()
        sys.exit(1)


def relative_error(value, reference) -> float:
    """``||value - reference|| / ||reference||`` in float64 (0 when both are zero)."""
    diff = (value.double() - reference.double()).norm().item()
    scale = reference.double().norm().item()
    return diff / scale if scale > 0 else diff


def tolerance(dtype, baseline_error: float, factor: float = 2.0) -> float:
    """The bound a kernel's error is held to: ``factor`` times the larger of the PyTorch path's own error in the same
    dtype (same inputs, same oracle) and the dtype's unit roundoff."""
    return factor * max(baseline_error, UNIT_ROUNDOFF[str(dtype)])


def compare(result: Result, name: str, candidate, baseline, oracle, dtype, factor: float = 2.0) -> bool:
    """Check ``candidate`` (the Triton path) against ``oracle`` (float64) no worse than ``baseline`` (the PyTorch path
    in the same dtype), by :func:`tolerance`; non-finite values fail."""
    import torch

    finite = bool(torch.isfinite(candidate).all())
    e_candidate, e_baseline = relative_error(candidate, oracle), relative_error(baseline, oracle)
    bound = tolerance(dtype, e_baseline, factor)
    return result.check(name, finite and e_candidate <= bound, error_triton=e_candidate, error_torch=e_baseline,
                        bound=bound, finite=finite, dtype=str(dtype))


def cuda_time(fn: Callable[[], object], reps: int = 10, warmup: int = 2) -> dict:
    """Median and spread of ``fn``'s wall time (CUDA events around each call, after warm-up), in ms; on the CPU of a
    smoke run, wall time (one repeat)."""
    import torch

    if DEVICE != "cuda":
        reps, warmup = 1, 0
    for _ in range(warmup):
        fn()
    times = []
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    else:
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": len(times)}


def peak_bytes(fn: Callable[[], object]) -> int | None:
    """Peak CUDA memory allocated by one call of ``fn`` above what was allocated before it (None off CUDA)."""
    import torch

    if DEVICE != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def elapsed(t0: float) -> float:
    return round(time.perf_counter() - t0, 2)


def finite_or_nan(x: float) -> float:
    return x if math.isfinite(x) else float("nan")
