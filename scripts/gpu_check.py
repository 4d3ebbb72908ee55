"""Run the GPU check's steps, most important first, each in its own process under a time limit, and keep one JSON
result (``$OUT/gpu_check.json``) current after every step, so a run killed from outside still reports.

    python scripts/gpu_check.py --out OUT [--budget 420] [--steps env,aot,...]   # normally via scripts/gpu_check.sh

Steps (``scripts/gpu_steps/<name>.py``; the limit of each is shrunk to what is left of ``--budget``):

========== ======= ========================================================================================
name       limit   what
========== ======= ========================================================================================
env         30 s   versions, GPU, ``import depthfusion_hf``, the installed versions against pyproject's bounds
aot        100 s   the AOT compile test's harness (tests/kernels/aot.py, CI cases) under this machine's Triton
ops        100 s   every op's Triton path against its PyTorch path at realistic shapes, values and gradients
cuda_tests  40 s   the CUDA-only tests of the suite (``tests/**/test_*_cuda.py``) with pytest
models      70 s   a bf16-autocast training step of every family against the fp32 PyTorch backend
decode     100 s   compiled static-cache decoding with CUDA graphs (``reduce-overhead``) of every family whose
                   ``_can_compile_fullgraph`` is True, against Llama: equal to eager to bf16 rounding, one graph
                   per model (no recompile), tokens/s
speed       50 s   speed and peak memory of each op: MoDA against SDPA (and flash-attn when installed), the others'
                   Triton against their PyTorch path (DWA: against a device copy)
========== ======= ========================================================================================

The limits add up to more than the default budget (490 s against 420 s): a step that ends early leaves its time to
the later ones, and the last (``speed``, the least important) gets what is left.

Without a CUDA device, ``env`` runs and every other step is recorded as skipped ("no CUDA device"); the exit
status is 0 when every step that ran passed, 1 otherwise (2 when there is no CUDA device).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = [  # (name, limit in seconds, needs CUDA)
    ("env", 30, False),
    ("aot", 100, True),
    ("ops", 100, True),
    ("cuda_tests", 40, True),
    ("models", 70, True),
    ("decode", 100, True),
    ("speed", 50, True),
]
NO_CUDA = "no CUDA device"
# A smoke run of the steps' code on a loaded CPU machine (tests/cuda/test_gpu_check.py) is slower than the real run:
# it scales every step's limit (the budget still bounds the whole run).
LIMIT_SCALE = float(os.environ.get("GPU_CHECK_LIMIT_SCALE", "1"))


def _write(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


def _status(rc: int | None, data: dict) -> str:
    if rc is None:
        return "timeout"
    if "error" in data or rc != 0:
        return "error"
    if any(not check["ok"] for check in data.get("checks", [])):
        return "failed"
    return "passed"


def run_step(name: str, limit: float, work: Path, out: Path, log) -> dict:
    """Run one step in its own process group; kill the group at ``limit`` seconds. Returns its record."""
    result_file = work / f"{name}.json"
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_steps" / f"{name}.py"), "--result", str(result_file),
           "--work", str(work)]
    t0 = time.perf_counter()
    log.write(f"\n===== step {name} (limit {limit:.0f} s) =====\n")
    log.flush()
    # the kernels the aot step compiled for sm_90 are in its cache: the later steps' launches find them there
    env = dict(os.environ, TRITON_CACHE_DIR=str(work / "aot-triton-cache"), GPU_CHECK_OUT=str(out),
               GPU_CHECK_STEP_LIMIT=str(round(limit)))  # a step that runs a child process can stop it in time
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    data = json.loads(result_file.read_text()) if result_file.exists() else {}
    return {"status": _status(rc, data), "seconds": round(time.perf_counter() - t0, 1), "limit_s": round(limit),
            "returncode": rc, **data}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=420, help="seconds for all steps together")
    parser.add_argument("--steps", default=",".join(name for name, _, _ in STEPS))
    parser.add_argument("--setup", default="{}", help="JSON from gpu_check.sh's set-up (wheels installed, site)")
    args = parser.parse_args(argv)
    wanted = args.steps.split(",")
    unknown = set(wanted) - {name for name, _, _ in STEPS}
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check.json"
    report = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "setup": json.loads(args.setup), "budget_s": args.budget, "steps": {}}
    _write(path, report)
    deadline = time.perf_counter() + args.budget
    has_cuda = None
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, open(args.out / "gpu_check.log", "a") as log:
        work = Path(tmp)
        for name, limit, needs_cuda in STEPS:
            if name not in wanted:
                continue
            if needs_cuda and has_cuda is False:
                report["steps"][name] = {"status": "skipped", "reason": NO_CUDA}
                _write(path, report)
                continue
            left = deadline - time.perf_counter()
            if left < 5:
                report["steps"][name] = {"status": "skipped", "reason": "the run's time budget is spent"}
                _write(path, report)
                continue
            report["steps"][name] = {"status": "running"}
            _write(path, report)
            record = run_step(name, min(limit * LIMIT_SCALE, left), work, args.out, log)
            report["steps"][name] = record
            if name == "env":  # unknown (None) when the step died before looking: the other steps then run
                cuda = record.get("notes", {}).get("cuda")
                has_cuda = None if cuda is None else bool(cuda.get("available"))
            _write(path, report)
            print(f"{name:8s} {record['status']:8s} {record['seconds']:6.1f} s", flush=True)
    report["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    statuses = [step["status"] for step in report["steps"].values()]
    report["result"] = NO_CUDA if has_cuda is False else (
        "passed" if all(s in ("passed", "skipped") for s in statuses) else "failed")
    _write(path, report)
    print(f"result: {report['result']} (details in {path})")
    if has_cuda is False:
        return 2
    return 0 if report["result"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
