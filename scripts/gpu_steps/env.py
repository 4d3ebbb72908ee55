"""Step ``env``: the machine and the versions; ``import depthfusion_hf`` works; every installed dependency meets
pyproject's lower bound (this is where torch 2.11 and Triton 3.6, the H200 machine's, are tested).

The CUDA note is written first, so that the dispatcher knows whether the CUDA steps can run even when the
package fails to import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, Result, step_main  # noqa: E402

DISTRIBUTIONS = ("torch", "triton", "transformers", "huggingface_hub", "tokenizers", "safetensors", "accelerate",
                 "numpy", "peft", "regex", "flash_attn", "matplotlib", "pytest")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda() -> dict:
    import torch

    info = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if info["available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(count=torch.cuda.device_count(), name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count,
                    bf16=torch.cuda.is_bf16_supported())
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["nvidia_smi"] = f"unavailable: {exc}"
    return info


def lower_bounds(pyproject: Path) -> dict[str, str]:
    """``{distribution: lower bound}`` (``name>=X``) of pyproject's dependencies and the ``triton`` and ``peft`` extras
    (the data and dev extras are not needed on the GPU machine)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    specs = list(project["dependencies"])
    for extra in ("triton", "peft"):
        specs += project.get("optional-dependencies", {}).get(extra, [])
    bounds = {}
    for spec in specs:
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*([^;]*)", spec)
        name, constraint = match.group(1), match.group(2)
        lower = re.search(r">=\s*([0-9][^,\s]*)", constraint)
        if lower:
            bounds[name.lower().replace("-", "_")] = lower.group(1)
    return bounds


def run(result: Result, args) -> None:
    result.note("python", sys.version.split()[0])
    result.note("cuda", _cuda())
    versions = {name: _version(name) for name in DISTRIBUTIONS}
    result.note("versions", versions)
    modules = {}
    for name in ("torch", "triton", "transformers"):
        try:
            modules[name] = importlib.import_module(name).__file__
        except Exception as exc:  # noqa: BLE001 - reported
            modules[name] = f"import failed: {type(exc).__name__}: {exc}"
    result.note("imported_from", modules)
    site = os.environ.get("GPU_CHECK_SITE")
    if site:  # each wheel installed by gpu_check.sh is the distribution this interpreter finds (not the machine's)
        for info in sorted(Path(site).glob("*.dist-info")):
            name, version = info.name.removesuffix(".dist-info").rsplit("-", 1)
            found = importlib.metadata.distribution(name)
            where = Path(str(found.locate_file(""))).resolve()
            result.check(f"wheel {name} {version} is the one imported", found.version == version
                         and where == Path(site).resolve(), found=found.version, location=str(where))

    from packaging.version import Version

    for name, lower in sorted(lower_bounds(REPO / "pyproject.toml").items()):
        installed = versions.get(name) or _version(name)
        if installed is None:
            continue  # optional (data, dev extras) and absent here
        result.check(f"{name} {installed} >= {lower} (pyproject lower bound)",
                     Version(installed).release >= Version(lower).release, installed=installed, lower_bound=lower)

    def import_package():
        import depthfusion_hf

        result.note("depthfusion_hf", depthfusion_hf.__file__)
        result.check("import depthfusion_hf", True, families=sorted(depthfusion_hf.FAMILIES))
        from depthfusion_hf.ops import attention_residual, depth_weighted_average, moda_attention  # noqa: F401

        result.check("import depthfusion_hf.ops", True)

    result.attempt("import depthfusion_hf", import_package)


if __name__ == "__main__":
    step_main(run)
