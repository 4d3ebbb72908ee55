"""Step ``aot``: the AOT compile test's harness (``tests/kernels/aot.py``, its CI cases) under this machine's Triton
and torch: every launch specialisation compiles for sm_80 and sm_90 within the shared-memory limits, without
spills in bf16 / fp16 configurations. One check per (case, target), as ``tests/kernels/test_aot_compile.py``.

The compiles run in as many processes as the machine has cores (minus one); their Triton cache is left in the
work folder, where the later steps find the sm_90 kernels already compiled.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, Result, step_main  # noqa: E402

sys.path.insert(0, str(REPO))

from tests.kernels import aot  # noqa: E402


def run(result: Result, args) -> None:
    import triton

    jobs = max(1, min(15, (os.cpu_count() or 2) - 1))
    result.note("harness", dict(triton=triton.__version__, jobs=jobs, cases=sorted(aot.CI_CASES)))
    out = Path(args.work) / "aot.jsonl"
    run_ = aot.run_harness("ci", out, jobs=jobs, timeout=3600)
    result.note("timing", run_.timing)
    if os.environ.get("GPU_CHECK_OUT"):  # the launches and compile results come back with the run
        shutil.copy(out, Path(os.environ["GPU_CHECK_OUT"]) / "aot_device.jsonl")
    for case in sorted(aot.CI_CASES):
        for capability in sorted(aot.TARGETS):
            failures = run_.failures(case, capability)
            result.check(f"{case} sm_{capability}", not failures, failures=failures)


if __name__ == "__main__":
    step_main(run)
