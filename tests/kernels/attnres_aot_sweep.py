"""The AttnRes kernels compiled for sm_80 and sm_90 as the launcher specialises them, over the hidden sizes and dtype
mixes the op accepts: registers, spills and shared memory per (kernel, D, dtypes, target, sources per launch, which
gradients), one JSON line each, and a summary (the worst registers and every spill) on stderr.

    python -m tests.kernels.attnres_aot_sweep 64,128,512,1024,2048,4096,8192 \
        bf16,fp16,bf16+bf16+fp32,fp16+fp16+fp32,fp32+bf16,fp32+fp16 1,3,5,8

A dtype ``a+b+c`` is the first source in ``a``, the others in ``b``, h and its gradient (the compute dtype) in ``c``
(``a+b``: c = a; ``a``: all three): ``fp32+bf16`` is an fp32 embedding beside bf16 outputs under autocast,
``bf16+bf16+fp32`` bf16 sources with fp32 parameters. The tile and warps are the launcher's (``_launch_shape``);
pointers, ``D``, ``M`` and ``first_col`` carry the divisibility-16 attribute a real launch gets; the gradients
kernel is compiled with both gradients and with each alone. Each specialisation goes through
``tests/kernels/aot.compile_launch`` (a fresh Triton cache, the wheel's ptxas). ``tests/kernels/aot.py`` compiles the
launches of real op and model calls (CI and ``benchmarks/aot_sweep.py``); this sweep covers the hidden sizes and
source counts those cases do not reach. The table is in docs/BENCHMARKS.md ("Ahead-of-time compile sweep").
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

KERNELS = ("attnres_fwd_kernel", "attnres_dots_kernel", "attnres_grads_kernel")
GRADIENTS = {"attnres_grads_kernel": [(True, True), (True, False), (False, True)]}
HALF = ("bf16", "fp16")


def compile_one(job: tuple[str, str, int, int, int, bool, bool]) -> dict:
    name, dtypes, dim, capability, n_chunk, has_dx, has_du = job
    from depthfusion_hf.models import attnres_triton as at
    from tests.kernels.aot import Launch, compile_launch

    parts = dtypes.split("+")
    first, rest, out = (parts + parts[:1] * 2)[:3] if len(parts) > 1 else parts * 3
    fn = getattr(at, name)
    block_t, block_d, warps = at._launch_shape(dim, at.GRADS_TILE if name == "attnres_grads_kernel" else
                                                at.FORWARD_TILE)
    params = [p.name for p in fn.params]
    signature = {}
    for p in params:
        if p[0] in "xg" and p[1:].isdigit():  # unused slots repeat x0 (and g0)
            signature[p] = "*" + (first if int(p[1:]) == 0 or int(p[1:]) >= n_chunk else rest)
        elif p in ("p_h", "p_dh"):
            signature[p] = "*" + out
        elif p.startswith("p_"):
            signature[p] = "*fp32"
        else:
            signature[p] = {"eps": "fp32", "M": "i32", "D": "i32", "N": "i32", "NUM_TILES": "i32",
                            "first_col": "i32"}.get(p, "constexpr")
    constants = {"N_CHUNK": n_chunk, "FIRST": True, "LAST": True, "HAS_DX": has_dx, "HAS_DU": has_du,
                 "BLOCK_T": block_t, "BLOCK_D": block_d}
    constexprs = [[[params.index(k)], v] for k, v in constants.items() if k in params]
    attrs = [[[i], [["tt.divisibility", 16]]] for i, p in enumerate(params)
             if signature[p].startswith("*") or (p == "D" and dim % 16 == 0) or p in ("M", "first_col")]
    launch = Launch("sweep", f"{fn.fn.__module__}:{fn.fn.__qualname__}", signature, constexprs, attrs,
                    {"num_warps": warps}, [1])
    result = compile_launch(launch, capability)
    return dict(kernel=name, dtypes=dtypes, D=dim, sm=capability, n_chunk=n_chunk, has_dx=has_dx, has_du=has_du,
                block_t=block_t, block_d=block_d, warps=warps, ok=result["ok"], registers=result.get("registers"),
                spills=result.get("spill_stores", 0) + result.get("spill_loads", 0), shared=result.get("shared"),
                half=any(t in HALF for t in dtypes.split("+")), error=result.get("error"))


def main(argv: list[str]) -> None:
    dims, dtypes, chunks = ([int(x) for x in argv[0].split(",")], argv[1].split(","),
                            [int(x) for x in argv[2].split(",")])
    jobs = [(k, t, d, cc, c, *g) for k in KERNELS for t in dtypes for d in dims for cc in (80, 90) for c in chunks
            for g in GRADIENTS.get(k, [(True, True)])]
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnres-aot-")
    rows = []
    with ProcessPoolExecutor(int(os.environ.get("AOT_JOBS", "2"))) as pool:
        for row in pool.map(compile_one, jobs):
            rows.append(row)
            print(json.dumps(row), flush=True)
    for kernel in KERNELS:
        for sm in (80, 90):
            mine = [r for r in rows if r["kernel"] == kernel and r["sm"] == sm]
            half_spills = [r for r in mine if r["half"] and r["spills"]]
            print(f"{kernel} sm_{sm}: {len(mine)} compiled, {sum(not r['ok'] for r in mine)} failed, max registers "
                  f"{max((r['registers'] or 0) for r in mine)}, bf16/fp16 with spills {len(half_spills)}, "
                  f"fp32 with spills {sum(1 for r in mine if not r['half'] and r['spills'])}", file=sys.stderr)
            for r in half_spills:
                print(f"  spill: {r}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
