"""The DWA kernels compiled ahead of time for A100 (sm_80) and H100/H200 (sm_90), without a GPU.

``triton.compile`` builds each kernel for a target through the ptxas the Triton wheel ships; ``cuobjdump``
reads the registers, local memory (spills) and shared memory of the cubin. Specialised as a real launch is:
every pointer (and M) divisible by 16, the dtypes the launch code passes. The sources are pointer arguments,
so half-precision loads are 16-byte vector loads (the old pointer-table kernel loaded them as scalar
``ld.global.b16``, the pointer read from a table defeating Triton's alignment specialisation).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles the real kernels: run without TRITON_INTERPRET", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from depthfusion_hf.models import dwa_triton  # noqa: E402

SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # dynamic shared memory per block (CUDA guide, per capability)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SOURCES = dwa_triton.SOURCES_PER_LAUNCH


def compile_kernel(kernel, types: dict[str, str], constexprs: dict, capability: int):
    """Compile ``kernel`` with the given parameter types (pointers and ``M`` divisible by 16, as launched)."""
    names = [p.name for p in kernel.params]
    signature = {name: types.get(name, "constexpr" if name in constexprs else "i32") for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if signature[name].startswith("*") or name == "M"}
    source = ASTSource(kernel, signature, constexprs, aligned)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})


def resource_usage(compiled) -> dict[str, int]:
    """``{"REG": ..., "LOCAL": ..., "SHARED": ..., "STACK": ...}`` of the compiled cubin (cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", cubin.name], capture_output=True,
                             text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|LOCAL|SHARED|STACK):(\d+)", out)}


def forward_types(source_dtypes: list[str], out: str) -> dict[str, str]:
    types = {f"x{i}": f"*{source_dtypes[min(i, len(source_dtypes) - 1)]}" for i in range(SOURCES)}
    return {**types, "p_w": "*fp32", "p_acc": "*fp32", "p_y": f"*{out}"}


def backward_types(dtype: str) -> dict[str, str]:
    types = {f"x{i}": f"*{dtype}" for i in range(SOURCES)} | {f"d{i}": f"*{dtype}" for i in range(SOURCES)}
    return {**types, "p_w": "*fp32", "p_g": f"*{dtype}", "p_dw_partial": "*fp32"}


FORWARD_CASES = {
    "bf16": (["bf16"], "bf16"),
    "fp16": (["fp16"], "fp16"),
    "fp32": (["fp32"], "fp32"),
    "autocast-bf16": (["fp32", "bf16"], "fp32"),  # an fp32 embedding among bf16 block outputs: promoted, fp32
}


@pytest.mark.parametrize("capability", [80, 90], ids=["sm_80", "sm_90"])
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_compiles_without_spills_and_loads_vectors(case, capability):
    sources, out = FORWARD_CASES[case]
    compiled = compile_kernel(dwa_triton.dwa_fwd_kernel, forward_types(sources, out),
                              {"ACCUMULATE": True, "BLOCK": 1024}, capability)
    usage = resource_usage(compiled)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage  # no register spills
    assert compiled.metadata.shared <= SHARED_LIMIT[capability]
    ptx = compiled.asm["ptx"]
    assert "ld.global.b16" not in ptx
    assert len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)) >= SOURCES  # one 16-byte load per source at least


@pytest.mark.parametrize("capability", [80, 90], ids=["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_backward_compiles_without_spills(dtype, capability):
    compiled = compile_kernel(dwa_triton.dwa_bwd_kernel, backward_types(dtype),
                              {"HAS_DX": True, "HAS_DW": True, "BLOCK": 1024}, capability)
    usage = resource_usage(compiled)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    assert compiled.metadata.shared <= SHARED_LIMIT[capability]
    assert "ld.global.b16" not in compiled.asm["ptx"]


def test_a_grid_past_cudas_limit_is_refused():
    """1024 elements per program: a state of 2^41 elements would need a grid of 2^31 blocks, past CUDA's x limit."""
    assert dwa_triton.launch_config(1024 * dwa_triton.MAX_GRID) == (1024, 4, dwa_triton.MAX_GRID)
    with pytest.raises(ValueError, match=r"at most 2147483647 blocks of 1024"):
        dwa_triton.launch_config(1024 * dwa_triton.MAX_GRID + 1)
