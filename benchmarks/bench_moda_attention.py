#!/usr/bin/env python
"""Benchmark ``moda_attention`` against ``scaled_dot_product_attention`` on the same sequence.

For each (T, L): MoDA attention with ``M = 2L`` depth entries per token (attention-side + FFN-side
KV of every preceding layer, as in the model) through each available backend, against
``torch.nn.functional.scaled_dot_product_attention`` on the same q, k, v with no depth entries
(the plain causal attention MoDA replaces). Forward and forward+backward; median time and peak
memory allocated during the call (above the inputs), with ratios against SDPA, all measured side
by side in one run. Backends: ``torch`` (vectorised PyTorch, what CPUs use), ``triton`` (the fused
kernel, CUDA only), ``reference`` (plain loops; only on request, tiny T).

The paper (arXiv 2603.15619, Table 2: A100, bf16, fwd+bwd, B=1, d=64, Hq=64, Hkv=8) reports MoDA at
97.3% of FlashAttention-2 speed at T=64K; ``--device cuda`` runs that comparison against SDPA's
flash backend (the ``torch`` path is skipped where its [T, S] probabilities would not fit).

    python benchmarks/bench_moda_attention.py                              # CPU, fp32, small T
    python benchmarks/bench_moda_attention.py --threads 1                  # ... on a shared machine
    python benchmarks/bench_moda_attention.py --device cuda --dtype bf16   # T = 4K..64K, Hq=64, Hkv=8

The implementations run interleaved (``harness.interleave``: process CPU time on CPU, wall time on CUDA);
the ``×SDPA`` ratios are medians of the paired per-repeat ratios. Results are printed as a markdown table and
appended to ``docs/bench/moda_attention.jsonl`` with the machine and its load named.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

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

from depthfusion_hf.ops import moda_attention  # noqa: E402


def make_inputs(B: int, Hq: int, Hkv: int, T: int, M: int, d: int, device: torch.device, dtype: torch.dtype,
                depth_layout: str = "stacked"):
    """q [B, Hq, T, d]; k, v [B, Hkv, T, d]; depth_k, depth_v [B, Hkv, T, M, d] (needing grad).

    ``depth_layout="stacked"``: the depth tensors are fresh contiguous leaves (a per-layer stack);
    ``"buffer"``: they are the first M entries of token-major [B, Hkv, T, M + 2, d] buffers (the
    model's depth stream, which reads a layer's entries in place; not contiguous).
    """
    g = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    if depth_layout == "buffer":
        depth = [leaf(B, Hkv, T, M + 2, d)[:, :, :, :M] for _ in range(2)]
    else:
        depth = [leaf(B, Hkv, T, M, d) for _ in range(2)]
    return [leaf(B, Hq, T, d), leaf(B, Hkv, T, d), leaf(B, Hkv, T, d), *depth]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA with native GQA (flash on CUDA for fp16/bf16)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def make_call(impl: str, inputs: list[torch.Tensor], backward: bool) -> Callable[[], object]:
    """A closure running one forward (and backward) of ``impl`` ("sdpa" or a moda_attention backend)."""
    q, k, v, depth_k, depth_v = inputs
    if impl == "sdpa":
        fn, leaves = (lambda: sdpa(q, k, v)), [q, k, v]
    else:
        fn, leaves = (lambda: moda_attention(q, k, v, depth_k, depth_v, backend=impl)), list(inputs)
    if not backward:
        def fwd() -> object:
            with torch.no_grad():
                return fn()
        return fwd
    grad_out = torch.ones_like(q)

    def fwd_bwd() -> object:
        out = fn()
        return torch.autograd.grad(out, leaves, grad_out)
    return fwd_bwd


def torch_path_fits(B: int, Hq: int, T: int, M: int, device: torch.device, limit_gib: float) -> bool:
    """The vectorised PyTorch path materialises [B, Hq, T, T + M] fp32 probabilities (x ~4 with backward)."""
    need = 4 * B * Hq * T * (T + M) * 4
    if device.type == "cuda":
        return need < 0.6 * torch.cuda.mem_get_info(device)[0]
    return need < limit_gib * 2**30


def sanity_check(impls: list[str], B: int, Hq: int, Hkv: int, T: int, d: int, device, dtype) -> dict[str, float]:
    """Max |MoDA(M=0) - SDPA| per backend: with no depth entries MoDA is plain causal attention."""
    q, k, v, depth_k, depth_v = make_inputs(B, Hq, Hkv, T, 0, d, device, dtype)
    with torch.no_grad():
        want = sdpa(q, k, v).float()
        return {impl: (moda_attention(q, k, v, depth_k, depth_v, backend=impl).float() - want).abs().max().item()
                for impl in impls}


def main(argv: Sequence[str] | None = None) -> dict:
    """Measure, print and record (see the module docstring); returns the record."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--T", type=int, nargs="+", default=None, help="sequence lengths")
    parser.add_argument("--L", type=int, nargs="+", default=None, help="preceding layers (M = 2L depth entries)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hq", type=int, default=None, help="query heads (default 8 on CPU, 64 on CUDA)")
    parser.add_argument("--hkv", type=int, default=None, help="KV heads (default 2 on CPU, 8 on CUDA)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--backends", nargs="+", default=None,
                        help="moda_attention backends (default: torch, plus triton when it can run)")
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--depth-layout", default="stacked", choices=["stacked", "buffer"],
                        help="depth entries as fresh tensors or as slices of a larger token-major buffer")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--cpu-torch-limit-gib", type=float, default=8.0,
                        help="skip the torch path above this estimated memory on CPU")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 gives stable timings on a shared machine)")
    parser.add_argument("--label", default="", help="free text stored with the record")
    parser.add_argument("--out", default=str(BENCH_DIR / "moda_attention.jsonl"),
                        help="results file (appended); '' to skip")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    Ts = args.T or ([4096, 16384, 65536] if cuda else [256, 512, 1024])
    Ls = args.L or ([0, 32, 64] if cuda else [0, 4, 12])  # L = 0: no depth entries (isolates the path)
    Hq, Hkv = args.hq or (64 if cuda else 8), args.hkv or (8 if cuda else 2)
    d, B = args.head_dim, args.batch
    warmup, reps = args.warmup or (3 if cuda else 1), args.reps or (10 if cuda else 3)
    impls = args.backends or (["torch", "triton"] if triton_available(device) else ["torch"])
    if "triton" in impls and not triton_available(device):
        raise SystemExit("the triton backend needs --device cuda and Triton")

    load_at_start = print_header("bench_moda_attention", device,
                                 f"B={B} Hq={Hq} Hkv={Hkv} d={d} {dtype}  warmup={warmup} reps={reps} (interleaved)  "
                                 f"backends={impls}  depth layout={args.depth_layout}")
    check = sanity_check(impls, B, Hq, Hkv, min(Ts[0], 256), d, device, dtype)
    print("sanity (M=0 vs SDPA, max abs diff): " + ", ".join(f"{k} {v:.1e}" for k, v in check.items()))

    header = ["T", "L", "M", "mode", "SDPA ms"] + [f"{i} ms (×SDPA)" for i in impls]
    header += ["SDPA MiB"] + [f"{i} MiB (×SDPA)" for i in impls]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    results = []
    for T in Ts:
        for L in Ls:
            M = 2 * L
            inputs = make_inputs(B, Hq, Hkv, T, M, d, device, dtype, args.depth_layout)
            for mode in args.modes:
                run = [i for i in ["sdpa", *impls]
                       if not (i == "torch" and not torch_path_fits(B, Hq, T, M, device, args.cpu_torch_limit_gib))
                       and not (i == "reference" and T > 256)]
                calls = {impl: make_call(impl, inputs, backward=mode == "fwd+bwd") for impl in run}
                times = interleave(calls, reps, device, warmup=warmup)
                row_ms = {impl: statistics.median(t) * 1e3 for impl, t in times.items()}
                ratio = {impl: paired(times[impl], times["sdpa"]).as_record() for impl in run}
                row_mib = {impl: peak_memory_bytes(calls[impl], device) / 2**20 for impl in run}
                del calls

                cells = [str(T), str(L), str(M), mode, f"{row_ms['sdpa']:.2f}"]
                cells += [f"{row_ms[i]:.2f} ({ratio[i]['median']:.2f}×)" if i in row_ms else "skipped"
                          for i in impls]
                cells += [f"{row_mib['sdpa']:.1f}"] + [
                    f"{row_mib[i]:.1f} ({row_mib[i] / max(row_mib['sdpa'], 1e-9):.2f}×)" if i in row_mib else "skipped"
                    for i in impls]
                print("| " + " | ".join(cells) + " |", flush=True)
                results.append(dict(T=T, L=L, M=M, mode=mode, time_ms=row_ms, ratio_vs_sdpa=ratio, peak_mib=row_mib))
            del inputs

    record = dict(record_header(device, argv, args.label, load_at_start), dtype=str(dtype), B=B, Hq=Hq, Hkv=Hkv, d=d,
                  warmup=warmup, reps=reps, depth_layout=args.depth_layout, sanity=check, results=results)
    if args.out:
        print(f"\nappended to {append_record(args.out, record)}")
    return record


if __name__ == "__main__":
    main()
