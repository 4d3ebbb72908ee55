"""``scripts/gpu_check.sh`` on this CPU machine: its set-up, its step dispatch and its JSON result.

- The set-up installs a wheelhouse offline (here a tiny wheel made by the test) into a fresh folder first on the
  path, the ``env`` step finds the package importable, the installed versions at or above pyproject's lower
  bounds and the wheel's distribution imported from that folder; without a CUDA device (``CUDA_VISIBLE_DEVICES``
  is emptied, so this holds on a GPU machine too) every other step is recorded as skipped and the script exits 2
  with a well-formed ``gpu_check.json`` whose result is "no CUDA device".
- A smoke run of the CUDA steps' own code at toy shapes on the CPU (``GPU_CHECK_DEVICE=cpu``, kernels interpreted):
  each step runs to its end and no check fails because of the check's code (a failure raised inside
  ``scripts/gpu_steps/`` itself); failures of the package (e.g. a dtype it rejects) are reported, not asserted here.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE = "depthfusion_gpu_check_probe"


def _fake_wheel(folder: Path, version: str = "0.0.1") -> Path:
    """A minimal pure-Python wheel (one module, dist-info with METADATA, WHEEL and RECORD)."""
    files = {f"{FAKE}.py": f"VERSION = {version!r}\n",
             f"{FAKE}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {FAKE}\nVersion: {version}\n",
             f"{FAKE}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{FAKE}-{version}.dist-info/RECORD,,")
    files[f"{FAKE}-{version}.dist-info/RECORD"] = "\n".join(record) + "\n"
    path = folder / f"{FAKE}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return path


def _raised_in(traceback_text: str) -> str:
    """The file of the innermost frame of a formatted traceback."""
    frames = [line for line in traceback_text.splitlines() if line.startswith('  File "')]
    return frames[-1] if frames else ""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEPTHFUSION_BACKEND", "PYTHONPATH")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable, **extra)
    return env


def test_gpu_check_reaches_no_cuda_device_with_a_well_formed_result(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels)
    out = tmp_path / "out"
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=_env(WHEELHOUSE=str(wheels), GPU_CHECK_BUDGET="200"))
    seconds = time.perf_counter() - t0
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["result"] == "no CUDA device", report
    assert report["setup"]["status"] == "ok" and report["setup"]["wheels"] == [f"{FAKE}-0.0.1-py3-none-any.whl"]
    assert not Path(report["setup"]["site"]).exists(), "the set-up's site folder is removed at the end"
    env = report["steps"]["env"]
    assert env["status"] == "passed", env
    assert env["notes"]["cuda"]["available"] is False
    names = [check["name"] for check in env["checks"]]
    assert "import depthfusion_hf" in names and any(name.startswith("torch ") for name in names), names
    assert f"wheel {FAKE} 0.0.1 is the one imported" in names, names
    assert all(check["ok"] for check in env["checks"]), [c for c in env["checks"] if not c["ok"]]
    others = {name: step for name, step in report["steps"].items() if name != "env"}
    assert set(others) == {"aot", "ops", "cuda_tests", "models", "decode", "speed"}
    assert all(step == {"status": "skipped", "reason": "no CUDA device"} for step in others.values()), others
    assert "result: no CUDA device" in output
    print(f"gpu_check.sh without CUDA: {seconds:.1f} s")


def test_gpu_check_refuses_a_missing_out_argument():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=_env())
    assert proc.returncode == 64 and "usage" in proc.stderr


@pytest.mark.integration
def test_cuda_steps_code_runs_at_toy_shapes_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = _env(GPU_CHECK_DEVICE="cpu", GPU_CHECK_SMOKE="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]),
               GPU_CHECK_LIMIT_SCALE="4")  # toy shapes, but interpreted kernels and 2 shared cores
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(out), "--steps",
                           "ops,models,decode,speed", "--budget", "900"], cwd=REPO, capture_output=True, text=True,
                          timeout=1000, env=env)
    report = json.loads((out / "gpu_check.json").read_text())
    steps = report["steps"]
    assert set(steps) == {"ops", "models", "decode", "speed"}, proc.stdout[-2000:]
    for name, step in steps.items():
        assert step["status"] in ("passed", "failed"), (name, step.get("error"), step.get("traceback"))
        assert step["checks"] or step["measurements"], name
        own = [check for check in step["checks"] if not check["ok"] and "traceback" in check
               and "scripts/gpu_steps/" in _raised_in(check["traceback"])]
        assert not own, (name, own)
    print(json.dumps({name: [c["name"] for c in step["checks"] if not c["ok"]] for name, step in steps.items()},
                     indent=1))
    # decode: Llama and DenseFormer (which claims _can_compile_fullgraph) decoded compiled, checked and timed
    decode = {m["name"].split(":")[0]: m for m in steps["decode"]["measurements"]}
    assert set(decode) == {"llama", "denseformer", "moda", "attnres-block", "attnres-full", "mhc"}, decode
    for variant in ("llama", "denseformer"):
        assert decode[variant]["supported"] is True and decode[variant]["compiled_tokens_per_s"] > 0, decode[variant]
        logits = [c for c in steps["decode"]["checks"] if c["name"].startswith(f"{variant}: compiled static-cache")]
        assert len(logits) == 1 and logits[0]["ok"], logits
    assert decode["denseformer"]["compiled_x_llama"] > 0


def _load_step(name: str):
    sys.path.insert(0, str(REPO / "scripts" / "gpu_steps"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "scripts" / "gpu_steps"))


def test_cuda_tests_step_reads_each_outcome_from_pytest_junit(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.kernels.test_dwa_cuda" name="test_a" time="0.5"/>'
        '<testcase classname="tests.kernels.test_dwa_cuda" name="test_b" time="0.1">'
        '<failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="tests.kernels.test_dwa_cuda" name="test_c" time="0">'
        '<skipped message="needs two CUDA devices"/></testcase>'
        '<testcase classname="tests.cuda.test_x" name="test_d" time="0"><error message="fixture"/></testcase>'
        "</testsuite></testsuites>")
    step = _load_step("cuda_tests")
    cases = {c["test"].split("::")[1]: c for c in step.outcomes(junit)}
    assert {n: c["outcome"] for n, c in cases.items()} == {"test_a": "passed", "test_b": "failed",
                                                           "test_c": "skipped", "test_d": "error"}
    assert cases["test_b"]["message"] == "assert 1 == 2\ntrace"
    assert cases["test_c"]["message"] == "needs two CUDA devices"
    files = [str(f) for f in step.cuda_test_files()]
    assert "tests/kernels/test_dwa_cuda.py" in files and "tests/cuda/test_token_inputs_cuda.py" in files, files


@pytest.mark.integration
def test_cuda_tests_step_without_cuda_records_each_file_skipped(tmp_path):
    """On the CPU every CUDA-only file skips itself (named on pytest's command line, as the step names them)."""
    result = tmp_path / "cuda_tests.json"
    env = _env(GPU_CHECK_DEVICE="cpu", PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    proc = subprocess.run([sys.executable, "scripts/gpu_steps/cuda_tests.py", "--result", str(result), "--work",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(result.read_text())
    assert data["notes"]["files"] == [str(f) for f in _load_step("cuda_tests").cuda_test_files()]
    outcomes = {c["name"]: c.get("outcome") for c in data["checks"]}
    assert all(c["ok"] for c in data["checks"]), data["checks"]
    assert [o for o in outcomes.values() if o is not None] == ["skipped"] * len(data["notes"]["files"]), outcomes
