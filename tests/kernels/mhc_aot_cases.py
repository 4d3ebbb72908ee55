"""The mHC kernels' launches, recorded on fake CUDA tensors and compiled for sm_80 and sm_90 (``tests/kernels/aot.py``'s
harness), one JSON line per (specialisation, target): ``python -m tests.kernels.mhc_aot_cases`` (TRITON_INTERPRET
unset).

Cases (``dtype/n/shape``): every kernel, forward and backward (the head included), in a training shape (B T = 1024
tokens, D = 1024: several programs, K chunks and token splits) and a decoding shape (one token, D = 1000); each
dtype at n = 4 (DeepSeek-V4's), and the tile choices of n = 1, 3 (BLOCK_R = 16) and 8 (TRITON_MAX_STREAMS) in bf16
and fp32. ``--all`` adds every (dtype, n in 1, 3, 4, 8) pair (about 470 compiles: half an hour on 2 cores).
"""

import json
import os
import sys
import tempfile

import torch

from tests.kernels.aot import backward, compile_launch, fake_cuda, problems, record_launches

SHAPES = {"train": (2, 512, 1024), "decode": (1, 1, 1000)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CASES = [(dtype, n) for dtype in DTYPES for n in (4,)] + [(dtype, n) for dtype in ("float32", "bfloat16")
                                                           for n in (1, 3, 8)]
ALL_CASES = [(dtype, n) for dtype in DTYPES for n in (1, 3, 4, 8)]


def run_ops(dtype: torch.dtype, batch: int, tokens: int, n: int, dim: int) -> None:
    from depthfusion_hf.models.mhc_connection import hyper_connection, hyper_head
    from depthfusion_hf.models.mhc_mix import hyper_mix

    def empty(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="cuda", dtype=dtype, requires_grad=True)

    rows = (2 + n) * n
    streams = empty(batch, tokens, n, dim, dtype=dtype)
    post, comb, collapsed = hyper_connection(streams, empty(rows, n * dim), empty(rows), empty(3), sinkhorn_iters=20,
                                             eps=1e-6, norm_eps=1e-6, backend="triton")
    head = hyper_head(streams, empty(n, n * dim), empty(n), empty(1), eps=1e-6, norm_eps=1e-6, backend="triton")
    mixed = hyper_mix(streams, empty(batch, tokens, dim, dtype=dtype), post, comb, backend="triton")
    backward([mixed, head, collapsed])


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1 is set: the harness needs real JIT functions")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="mhc_aot_")  # ptxas runs (and logs) only when not cached
    launches = []
    for dtype, n in ALL_CASES if "--all" in sys.argv else CASES:
        for shape_name, (batch, tokens, dim) in SHAPES.items():
            with fake_cuda(), record_launches(f"{dtype}/n{n}/{shape_name}", launches):
                run_ops(DTYPES[dtype], batch, tokens, n, dim)
    unique = {}
    for launch in launches:
        unique.setdefault(launch.spec_key(), launch)
    for launch in unique.values():
        for capability in (80, 90):
            result = compile_launch(launch, capability)
            print(json.dumps({"case": launch.case, "kernel": launch.kernel.split(":")[-1],
                              "specialisation": launch.describe(), "problems": problems(launch, result),
                              **{k: result.get(k) for k in ("target", "ok", "registers", "spill_stores",
                                                             "spill_loads", "shared")}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
