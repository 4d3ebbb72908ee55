"""Every Triton launch the package makes compiles for A100 (sm_80) and H100 / H200 (sm_90), without a GPU.

The harness (``tests/kernels/aot.py``) drives the public ops and the model forwards / backwards / decoding of
the covering subset ``aot.CI_CASES`` on CPU tensors that the launch code takes for CUDA tensors, records each
launch's specialisation at the Triton runtime boundary, and compiles each distinct one with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` in a fresh process and a fresh Triton cache
(compiled results are shared by the cases of one run, never across runs). One test per (target, case) asserts
that every kernel the case launches compiles, fits the target's dynamic shared memory (sm_80: 163 KiB per
block, sm_90: 227 KiB) and, in a bf16 / fp16 configuration, spills no register; a failure names the kernel and
its specialisation. ``benchmarks/aot_sweep.py`` runs every case and writes the table.

``AOT_JOBS`` sets the compile processes (default 2, this machine's cores); ``AOT_CASES`` another selection of
cases than the CI subset (``all``, or names / prefixes, as ``python -m tests.kernels.aot --cases``).
"""

from __future__ import annotations

import os

import pytest

from tests.kernels import aot

SELECTION = os.environ.get("AOT_CASES", "ci")
CI_CASES = aot.select_cases(SELECTION)


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory) -> aot.Run:
    out = tmp_path_factory.mktemp("aot") / "aot.jsonl"
    return aot.run_harness(SELECTION, out, jobs=int(os.environ.get("AOT_JOBS", "2")), timeout=1800)


@pytest.mark.integration
def test_every_ci_case_launches_a_kernel(harness_run):
    """A case that launches nothing (or raises) checks nothing: each one reaches the kernels it is named after."""
    problems = {case: error for case, error in harness_run.case_errors.items() if error}
    silent = [case for case in CI_CASES if case not in problems
              and not any(launch.case == case for launch in harness_run.launches)]
    assert not silent, f"cases that launched no kernel: {silent}"
    families = {launch.kernel.split(":")[0].split(".")[-1] for launch in harness_run.launches}
    if SELECTION == "ci":
        assert {"dwa_triton", "attnres_triton", "moda_triton", "mhc_triton"} <= families, families


@pytest.mark.integration
@pytest.mark.parametrize("capability", sorted(aot.TARGETS), ids=lambda cc: f"sm_{cc}")
@pytest.mark.parametrize("case", CI_CASES)
def test_kernels_compile(harness_run, case, capability):
    failures = harness_run.failures(case, capability)
    assert not failures, f"{case} on sm_{capability}:\n" + "\n".join(failures)
