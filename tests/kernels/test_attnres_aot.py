"""The AttnRes kernels compiled ahead of time for sm_90 (no GPU: ``triton.compile`` with the wheel's ptxas): every
pointer offset built from a token index is 64-bit, so ``token * D`` (or ``token * N``) past 2^31 cannot wrap (a
[B * T, D] bf16 activation passes 2^31 elements at B * T = 524288 tokens with D = 4096). Registers, spills and
shared memory of every launch the package makes are checked by ``test_aot_compile.py`` (and the full sweep,
``benchmarks/aot_sweep.py``); the table is in docs/ATTNRES.md.
"""

from __future__ import annotations

import os
import re

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles real JIT functions: TRITON_INTERPRET must be unset", allow_module_level=True)
triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from depthfusion_hf.models import attnres_triton  # noqa: E402

BLOCK_T, BLOCK_D = 2, 4096  # distinct sizes: a token-indexed tensor is <2x...>, a row-indexed one <4096x...>
SOURCES = {f"x{i}": "*bf16" for i in range(8)}
KERNELS = {
    "attnres_fwd_kernel": (
        {**SOURCES, "p_u": "*fp32", "p_p": "*fp32", "p_r": "*fp32", "p_m": "*fp32", "p_l": "*fp32", "p_acc": "*fp32",
         "p_h": "*bf16", "p_lse": "*fp32", "M": "i32", "D": "i32", "N": "i32", "first_col": "i32", "eps": "fp32"},
        {"N_CHUNK": 8, "FIRST": False, "LAST": True}),
    "attnres_dots_kernel": (
        {**SOURCES, "p_dh": "*bf16", "p_da": "*fp32", "M": "i32", "D": "i32", "N": "i32", "first_col": "i32"},
        {"N_CHUNK": 8}),
    "attnres_grads_kernel": (
        {**SOURCES, **{f"g{i}": "*bf16" for i in range(8)}, "p_u": "*fp32", "p_dh": "*bf16", "p_alpha": "*fp32",
         "p_b": "*fp32", "p_e": "*fp32", "p_du": "*fp32", "M": "i32", "D": "i32", "N": "i32", "first_col": "i32",
         "NUM_TILES": "i32"},
        {"N_CHUNK": 8, "HAS_DX": True, "HAS_DU": True}),
}


def ttir(name: str) -> str:
    fn = getattr(attnres_triton, name)
    signature, constants = KERNELS[name]
    constants = {**constants, "BLOCK_T": BLOCK_T, "BLOCK_D": BLOCK_D}
    params = [p.name for p in fn.params]
    signature = {p: signature.get(p, "constexpr") for p in params}
    src = ASTSource(fn, signature, {(params.index(k),): v for k, v in constants.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16}).asm["ttir"]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_token_offsets_are_64_bit(name):
    """Every ``tt.addptr`` over a token tile ([BLOCK_T] or [BLOCK_T, BLOCK_D]) adds i64 offsets."""
    offsets = re.findall(rf"tt\.addptr .* : tensor<{BLOCK_T}x(?:{BLOCK_D}x)?!tt\.ptr<\w+>>, tensor<([0-9x]+)(i\d+)>",
                         ttir(name))
    assert offsets, "no token-indexed pointer arithmetic found (the kernel or its IR changed)"
    assert {width for _, width in offsets} == {"i64"}, offsets
