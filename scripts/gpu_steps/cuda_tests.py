"""Step ``cuda_tests``: the CUDA-only tests of the test suite, run with pytest on this machine's GPU.

Every ``tests/**/test_*_cuda.py`` (now ``tests/kernels/test_dwa_cuda.py``: a second device, the current stream,
CUDA-graph capture, dynamo tracing of the Triton DWA; ``tests/cuda/test_token_inputs_cuda.py``: token ids
checked without a host sync) skips itself, or is not collected, without a CUDA device, so CI never runs it; here
they run in one ``pytest`` process (one interpreter start-up), stopped 5 s before the step's limit
(``GPU_CHECK_STEP_LIMIT``, set by the dispatcher) so that the step still reports; each test is one check
(passed, or skipped with pytest's reason; failed or errored with its message), and the run one more (pytest's
exit status; on a CUDA machine a run where no test ran is a failure; a time-out records pytest's output so far).
pytest must be importable (the ``env`` step lists its version).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEVICE, REPO, Result, step_main  # noqa: E402


def cuda_test_files() -> list[Path]:
    """The CUDA-only test files, relative to the checkout, in name order."""
    return sorted(path.relative_to(REPO) for path in REPO.glob("tests/**/test_*_cuda.py"))


def outcomes(junit: Path) -> list[dict]:
    """One ``{"test", "outcome", "message"}`` per test case of a pytest JUnit XML file."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (child.get("message") or "") + ("\n" + child.text if child.text and tag != "skipped" else "")
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "message": message[-2000:], "seconds": float(case.get("time") or 0)})
    return cases


def run_pytest(result: Result, files: list[Path], work: Path) -> None:
    """One pytest process over ``files`` (one interpreter start-up), stopped 5 s before the step's limit."""
    junit = work / "junit-cuda-tests.xml"
    limit = float(os.environ.get("GPU_CHECK_STEP_LIMIT", "600"))
    # -o addopts=: pyproject's "-n 2" needs pytest-xdist, which that machine may lack; one process suits a GPU
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rs",
               f"--junitxml={junit}", *map(str, files)]
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=max(1.0, limit - 5))
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = None
        output = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
    print(output[-6000:], flush=True)
    cases = outcomes(junit) if junit.exists() else []
    for case in cases:
        result.check(case["test"], case["outcome"] in ("passed", "skipped"), outcome=case["outcome"],
                     message=case["message"], seconds=case["seconds"])
    ran = [c for c in cases if c["outcome"] != "skipped"]
    # pytest's exit status: 0 all passed, 1 some failed, 5 nothing collected (the files skip without CUDA)
    ok = returncode == 0 or (returncode == 5 and DEVICE != "cuda")
    result.check("pytest " + " ".join(map(str, files)), ok and (bool(ran) or DEVICE != "cuda"),
                 returncode=returncode, tests=len(cases), ran=len(ran), output=output[-1500:])


def run(result: Result, args) -> None:
    if importlib.util.find_spec("pytest") is None:
        result.check("pytest importable", False, error="pytest is not installed for this interpreter: carry its "
                     "wheels (pytest, pluggy, iniconfig, pygments) in the wheelhouse (scripts/build_wheelhouse.sh)")
        return
    files = cuda_test_files()
    result.note("files", [str(f) for f in files])
    run_pytest(result, files, Path(args.work))


if __name__ == "__main__":
    step_main(run)
