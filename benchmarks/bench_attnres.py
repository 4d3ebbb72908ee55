#!/usr/bin/env python
"""Benchmark the ``attention_residual`` op (AttnRes) against the plain residual sum it replaces.

For each (tokens, D, N sources) it times forward and forward+backward (gradients of the query, the
norm weight and every source) of

- ``sum``        ``sum_i v_i``: the unit-weight residual stream of a pre-norm Llama (the floor);
- ``reference``  the loop over sources (``backend="reference"``), small shapes only;
- ``torch``      the vectorised PyTorch path (``backend="torch"``);
- ``triton``     the fused kernels (``backend="triton"``, CUDA only).

and reports the median time, the peak memory allocated during the call, the ratio to ``sum``, and on
CUDA the fused kernel's effective bandwidth (bytes the op must move: ``(N + 1) M D`` elements forward,
``(2N + 2) M D`` (fp32) or ``(3N + 1) M D`` (half) more backward). The implementations run interleaved
(``harness.interleave``); the ``×sum`` ratios are medians of the paired per-repeat ratios. Results are printed as
a markdown table and appended to ``docs/bench/attnres.jsonl`` with the machine and its load named.

    python benchmarks/bench_attnres.py --threads 1                 # CPU, fp32
    python benchmarks/bench_attnres.py --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BENCH_DIR,
    DTYPES,
    append_record,
    interleave,
    paired,
    peak_memory_bytes,
    print_header,
    record_header,
    triton_available,
)

from depthfusion_hf.ops import attention_residual  # noqa: E402


def make_inputs(tokens: int, dim: int, n_src: int, device, dtype):
    """``(query [D], N sources [1, tokens, D], norm weight [D])``, all requiring grad."""
    gen = torch.Generator().manual_seed(0)
    query = (torch.randn(dim, generator=gen) / dim**0.5).to(device).requires_grad_()
    weight = torch.ones(dim, device=device, requires_grad=True)
    sources = [torch.randn(1, tokens, dim, generator=gen).to(device, dtype).requires_grad_() for _ in range(n_src)]
    return query, sources, weight


def make_call(impl: str, inputs, backward: bool) -> Callable[[], None]:
    """A closure running one forward (and backward) of ``impl`` on ``inputs``."""
    query, sources, weight = inputs
    grad = torch.randn_like(sources[0])

    def forward():
        if impl == "sum":
            return sum(sources[1:], sources[0])
        return attention_residual(query, sources, weight, backend=impl)

    def call():
        if backward:
            torch.autograd.grad(forward(), [query, weight, *sources] if impl != "sum" else sources, grad)
        else:
            with torch.no_grad():
                forward()

    return call


def bytes_moved(tokens: int, dim: int, n_src: int, dtype: torch.dtype, backward: bool) -> int:
    """The minimum traffic of the fused kernels (see the module docstring)."""
    rows = n_src + 1
    if backward:
        rows += 2 * n_src + 2 if dtype == torch.float32 else 3 * n_src + 1
    return rows * tokens * dim * torch.finfo(dtype).bits // 8


def main(argv: Sequence[str] | None = None) -> dict:
    """Measure, print and record (see the module docstring); returns the record."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="B * T per call")
    parser.add_argument("--dim", type=int, nargs="+", default=None, help="hidden sizes D")
    parser.add_argument("--sources", type=int, nargs="+", default=None, help="N (block AttnRes: blocks + 1)")
    parser.add_argument("--backends", nargs="+", default=None,
                        help="default: reference and torch, plus triton when it can run")
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1: stable on a shared machine)")
    parser.add_argument("--label", default="", help="free text stored with the record")
    parser.add_argument("--out", default=str(BENCH_DIR / "attnres.jsonl"), help="results file (appended); '' to skip")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    token_counts = args.tokens or ([16384, 65536] if cuda else [512, 2048])
    dims = args.dim or ([2048, 4096] if cuda else [256, 512])
    n_sources = args.sources or [2, 9, 25]
    warmup, reps = args.warmup or (3 if cuda else 1), args.reps or (20 if cuda else 5)
    impls = args.backends or (["reference", "torch"] + (["triton"] if triton_available(device) else []))
    if "triton" in impls and not triton_available(device):
        raise SystemExit("the triton backend needs --device cuda and Triton")

    load_at_start = print_header("bench_attnres", device,
                                 f"{dtype}  warmup={warmup} reps={reps} (interleaved)  backends={impls}")
    header = ["tokens", "D", "N", "mode", "sum ms"] + [f"{i} ms (×sum)" for i in impls] + ["sum MiB"]
    header += [f"{i} MiB" for i in impls] + (["triton GB/s"] if "triton" in impls else [])
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    results = []
    for tokens in token_counts:
        for dim in dims:
            for n_src in n_sources:
                inputs = make_inputs(tokens, dim, n_src, device, dtype)
                for mode in args.modes:
                    backward = mode == "fwd+bwd"
                    run = [i for i in ["sum", *impls] if not (i == "reference" and tokens * dim * n_src > (1 << 24))]
                    calls = {impl: make_call(impl, inputs, backward) for impl in run}
                    times = interleave(calls, reps, device, warmup=warmup)
                    row_ms = {impl: statistics.median(t) * 1e3 for impl, t in times.items()}
                    ratio = {impl: paired(times[impl], times["sum"]).as_record() for impl in run}
                    row_mib = {impl: peak_memory_bytes(calls[impl], device) / 2**20 for impl in run}
                    cells = [str(tokens), str(dim), str(n_src), mode, f"{row_ms['sum']:.3f}"]
                    cells += [f"{row_ms[i]:.3f} ({ratio[i]['median']:.2f}×)" if i in row_ms else "skipped"
                              for i in impls]
                    cells += [f"{row_mib['sum']:.1f}"] + [f"{row_mib[i]:.1f}" if i in row_mib else "skipped"
                                                          for i in impls]
                    gbps = None
                    if "triton" in row_ms:
                        gbps = bytes_moved(tokens, dim, n_src, dtype, backward) / (row_ms["triton"] * 1e-3) / 1e9
                        cells.append(f"{gbps:.0f}")
                    print("| " + " | ".join(cells) + " |", flush=True)
                    results.append(dict(tokens=tokens, D=dim, N=n_src, mode=mode, time_ms=row_ms, ratio_vs_sum=ratio,
                                        peak_mib=row_mib, triton_gbps=gbps))
                del inputs

    record = dict(record_header(device, argv, args.label, load_at_start), dtype=str(dtype), warmup=warmup, reps=reps,
                  results=results)
    if args.out:
        print(f"\nappended to {append_record(args.out, record)}")
    return record


if __name__ == "__main__":
    main()
