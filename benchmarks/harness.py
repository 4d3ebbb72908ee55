"""The harness every benchmark script uses: one clock, interleaved repeats, paired ratios, peak memory, records.

- **Clock** (:func:`clock`): process CPU time on CPU (steady when other jobs share the cores), wall time on CUDA
  (with a synchronisation around each timed call).
- **Interleaved repeats** (:func:`interleave`): repeat i times every candidate once, back to back, the order
  reversed every other repeat, so machine load and cache state hit all candidates alike.
- **Paired ratios** (:func:`paired`): repeat i of a candidate ÷ repeat i of the baseline; the verdicts use the
  median of these ratios, reported with their [min, max] (:class:`Spread`).
- **Peak memory** (:func:`peak_memory_bytes`): bytes allocated during one call above what was allocated before.
- **Records** (:func:`record_header`, :func:`append_record`): one JSON object per run appended to a
  ``docs/bench/*.jsonl`` file, naming the machine, its load, torch, the commit and the command.
- **Another checkout** (:func:`load_family_folder`, :func:`load_before_families`): a self-contained
  ``models/<family>`` folder of an older checkout imported under another package name (``moda_before``), so old
  and new code run interleaved in one process.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / "docs" / "bench"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------------
# Clocks and repeats
# ---------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> Callable[[], float]:
    """The timer: process CPU time on CPU (steady when other jobs share the cores), wall time on CUDA."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def clock_name(device: torch.device) -> str:
    """``"process CPU time"`` or ``"wall time"`` (what :func:`clock` measures, for tables and records)."""
    return "process CPU time" if device.type == "cpu" else "wall time"


def time_call(call: Callable[[], object], device: torch.device) -> float:
    """Seconds one ``call()`` takes by :func:`clock` (CUDA work finished before and after)."""
    now = clock(device)
    sync(device)
    start = now()
    call()
    sync(device)
    return now() - start


def interleave(calls: Mapping[str, Callable[[], object]], reps: int, device: torch.device,
               warmup: int = 1) -> dict[str, list[float]]:
    """Time every call ``reps`` times, interleaved: repeat i runs each call once, the order reversed every other
    repeat. ``warmup`` untimed rounds run first. Returns the seconds of each call per repeat, in repeat order."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1; got {reps}")
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else reversed(names)):
            times[name].append(time_call(calls[name], device))
    return times


@dataclass(frozen=True)
class Spread:
    """The median of a list of values with its extremes (``values`` in repeat order)."""

    median: float
    min: float
    max: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of ``values`` (at least one)."""
        values = tuple(float(v) for v in values)
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(values), min(values), max(values), values)

    def text(self, digits: int = 3) -> str:
        """``"1.071 [1.050, 1.093]"``."""
        return f"{self.median:.{digits}f} [{self.min:.{digits}f}, {self.max:.{digits}f}]"

    def as_record(self) -> dict:
        """JSON-ready fields."""
        return dict(asdict(self), values=list(self.values))


def paired(values: Sequence[float], base: Sequence[float]) -> Spread:
    """Paired ratios ``values[i] / base[i]`` (repeat i of a candidate ÷ repeat i of the baseline, measured back to
    back) and their spread."""
    if len(values) != len(base) or not values:
        raise ValueError(f"paired ratios need equal, non-empty lists; got {len(values)} and {len(base)} values")
    return Spread.of([v / b for v, b in zip(values, base)])


def meets(value: float, bound: float, higher_is_better: bool) -> bool:
    """Whether a ratio meets its bound (``>=`` for speeds, ``<=`` for times and memory)."""
    return value >= bound if higher_is_better else value <= bound


def triton_available(device: torch.device) -> bool:
    """Whether a Triton backend can run here: a CUDA device and an importable ``triton``."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


# ---------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# The machine and the record
# ---------------------------------------------------------------------------------------------------


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


def machine_load() -> dict:
    """The 1-minute load average and the CPU count (the machine is shared: every record says how loaded it was)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return dict(load_1min=round(load, 2), cpus=os.cpu_count())


def git_commit(repo: Path = REPO) -> str:
    """The short commit id of the checkout at ``repo``, or ``"unknown"``."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


def package_source() -> dict:
    """Where the measured ``depthfusion_hf`` was imported from: its folder, the commit of the checkout holding it
    and whether that checkout's ``src/`` differs from the commit (``dirty``: uncommitted changes were measured), so
    a record never credits a commit with code it did not contain."""
    import depthfusion_hf

    folder = Path(depthfusion_hf.__file__).resolve().parent
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=folder, capture_output=True,
                                text=True, check=True).stdout
        dirty = bool(status.strip())
    except Exception:
        dirty = None
    return dict(package=str(folder), package_commit=git_commit(folder), package_dirty=dirty)


def record_header(device: torch.device, argv: Sequence[str] | None = None, label: str = "",
                  load_at_start: dict | None = None) -> dict:
    """What every record starts with: date, machine, load (at the end; ``load_at_start``: the one
    :func:`print_header` saw), torch, commit (of the benchmark scripts), where the measured package came from
    (:func:`package_source`), the command, a free-text label."""
    argv = sys.argv if argv is None else [sys.argv[0], *argv]
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), machine=machine_name(device),
                load=machine_load(), load_at_start=load_at_start, torch=torch.__version__, commit=git_commit(),
                **package_source(), device=str(device), command="python " + " ".join(argv), label=label)


def append_record(path: str | os.PathLike, record: dict) -> Path:
    """Append ``record`` as one JSON line to ``path`` (its folder created if needed); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return path


def print_header(script: str, device: torch.device, details: str) -> dict:
    """The first lines of every benchmark's output: machine, load, torch, commit, clock, then ``details``; returns
    the load (for :func:`record_header`'s ``load_at_start``)."""
    load, source = machine_load(), package_source()
    dirty = " + uncommitted changes" if source["package_dirty"] else ""
    print(f"# {script}  machine: {machine_name(device)}  load {load['load_1min']} on {load['cpus']} CPUs  "
          f"torch {torch.__version__}  package {source['package']} at {source['package_commit']}{dirty}  "
          f"clock: {clock_name(device)}")
    print(f"# {details}")
    return load


# ---------------------------------------------------------------------------------------------------
# Another checkout's family folders
# ---------------------------------------------------------------------------------------------------


def family_folder(checkout: Path, family: str) -> Path:
    """The folder holding ``family``'s modules in ``checkout``: ``src/depthfusion_hf/models`` (one folder for every
    family), or ``models/<family>`` in a checkout from before that layout. ``checkout`` may also be such a models
    folder or an old family folder itself (it holds an ``__init__.py``)."""
    checkout = Path(checkout)
    if (checkout / "__init__.py").is_file():
        if (checkout / f"modeling_{family}.py").is_file() or (checkout / family).is_dir():
            return checkout / family if (checkout / family).is_dir() else checkout
        return checkout.parent / family
    models = checkout / "src" / "depthfusion_hf" / "models"
    return models / family if (models / family).is_dir() else models


def load_family_folder(folder: Path, family: str, name: str) -> ModuleType:
    """Import a self-contained ``models/<family>`` folder (e.g. of an older checkout) as the package ``name``.

    ``folder`` is the family folder itself or a checkout (its ``src/depthfusion_hf/models/<family>`` is used),
    so an old and a new version of the same family can be timed side by side in one process.

    Raises:
        FileNotFoundError: the folder has no ``__init__.py``.
    """
    folder = family_folder(folder, family)
    if not (folder / "__init__.py").is_file() or not _holds_family(folder, family):
        raise FileNotFoundError(f"{folder} holds no {family} package (no __init__.py or no modeling_{family}.py)")
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        for kind in ("configuration", "modeling"):  # one folder for every family: the family's names on the package
            loaded = importlib.import_module(f"{name}.{kind}_{family}")
            for attribute in getattr(loaded, "__all__", None) or [a for a in vars(loaded) if not a.startswith("_")]:
                setattr(module, attribute, getattr(module, attribute, None) or getattr(loaded, attribute))
    except BaseException:
        for loaded_name in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded_name]
        raise
    return module


def _holds_family(folder: Path, family: str) -> bool:
    return (folder / f"modeling_{family}.py").is_file()


def load_before_families(checkout: Path, families: Sequence[str]) -> dict[str, ModuleType]:
    """Each of ``families`` from ``checkout``, imported as ``<family>_before``; a family the checkout does not have
    is left out (with a line on stdout saying so)."""
    loaded = {}
    for family in families:
        folder = family_folder(checkout, family)
        if not (folder / "__init__.py").is_file() or not _holds_family(folder, family):
            print(f"# --before {checkout}: no {family} package ({folder}); no {family} -before models")
            continue
        loaded[family] = load_family_folder(folder, family, f"{family}_before")
    return loaded
