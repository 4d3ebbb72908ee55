#!/usr/bin/env python
"""Benchmark the Depth-Weighted Average over a whole forward + backward through depth.

Simulates a k×p DenseFormer of ``d`` blocks in which each block is a cheap memory-bound op
(``X_i = s_i * Y_{i-1}``, a learnable scalar, so the DWA is what the timings see) and compares:

- ``none``      no DWA at all: the floor (a plain transformer's residual stream);
- ``paper``     the paper's package re-implemented from its description (arXiv 2402.02622, App. A.2,
                Listing 3): per-dilation-residue accumulators pre-allocated with ``zeros``, every block
                output copied into them in place through ``InPlaceSetSlice``, then
                ``tensordot(alpha, accumulator[:n])`` -- the **baseline**;
- ``reference`` the paper's naive loop (Listing 1), ``backend="reference"``;
- ``torch``     our PyTorch path over the list of sources (``backend="torch"``);
- ``triton``    our fused kernel (``backend="triton"``, CUDA only).

Reported per (depth, k×p): median time of forward+backward, peak memory allocated during it,
and ratios against the baseline; ``DWA ms`` is the time above ``none``. On CUDA a second table
gives the fused kernel's achieved bandwidth as a fraction of the device's measured copy bandwidth.
Results are appended to ``docs/bench/dwa.jsonl`` with the machine named.

    python benchmarks/bench_dwa.py                       # CPU, fp32
    python benchmarks/bench_dwa.py --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BENCH_DIR,
    DTYPES,
    append_record,
    clock_name,
    interleave,
    paired,
    peak_memory_bytes,
    print_header,
    record_header,
    sync,
    triton_available,
)

from depthfusion_hf.ops import depth_weighted_average  # noqa: E402


# ----------------------------------------------------------------------------------------------
# The baseline: the paper's accumulator + tensordot package, re-implemented from Listing 3.
# ----------------------------------------------------------------------------------------------
class InPlaceSetSlice(torch.autograd.Function):
    """Write ``x_val`` into ``full_tensor[x_idx]`` in place; return a view of ``full_tensor[:x_idx + 1]``.

    The backward splits the gradient of the returned slice into the previous slice's part and
    ``x_val``'s part, which is how the paper keeps autograd happy with a pre-allocated buffer.
    """

    @staticmethod
    def forward(ctx, full_tensor, last_slice, x_idx, x_val):
        full_tensor[x_idx] = x_val
        ctx.x_idx = x_idx
        ret = torch.empty(0, device=full_tensor.device, dtype=full_tensor.dtype)
        ret.set_(full_tensor[: x_idx + 1])
        return ret

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.x_idx == 0:
            return None, None, None, grad_out[ctx.x_idx]
        return None, grad_out[: ctx.x_idx], None, grad_out[ctx.x_idx]


class PaperDWAModules(torch.nn.Module):
    """The paper's ``DWAModules``: one weight vector per DWA step, accumulators per dilation residue."""

    def __init__(self, n_blocks: int, dilation: int, period: int, device, dtype):
        super().__init__()
        self.n_blocks, self.dilation, self.period = n_blocks, dilation, period
        self.alphas = torch.nn.ParameterList()
        self.alpha_index: dict[int, int] = {}
        for i in range(n_blocks):
            if (i + 1) % period == 0:
                w = torch.zeros((i + 1 + dilation) // dilation, device=device, dtype=dtype)
                w[-1] = 1.0
                self.alpha_index[i] = len(self.alphas)
                self.alphas.append(torch.nn.Parameter(w))
        self.accumulators = None

    def init_accumulators(self, x: torch.Tensor) -> None:
        accs = []
        for r in range(self.dilation):
            size = (self.n_blocks + 1) // self.dilation + (1 if r < (self.n_blocks + 1) % self.dilation else 0)
            accs.append((torch.zeros((size, *x.shape), device=x.device, dtype=x.dtype), None))
        accs[0] = self._set(accs[0], 0, x)
        self.accumulators = accs

    @staticmethod
    def _set(acc, idx, x):
        full, last = acc
        return full, InPlaceSetSlice.apply(full, last, idx, x)

    def forward(self, x: torch.Tensor, block_idx: int) -> torch.Tensor:
        r = (block_idx + 1) % self.dilation
        self.accumulators[r] = self._set(self.accumulators[r], (block_idx + 1) // self.dilation, x)
        if (block_idx + 1) % self.period == 0:
            alpha = self.alphas[self.alpha_index[block_idx]]
            x = torch.tensordot(alpha, self.accumulators[r][1], dims=1)
        return x


# ----------------------------------------------------------------------------------------------
# Our DWA in the model's pattern (same as DenseFormerModel.forward).
# ----------------------------------------------------------------------------------------------
class OurDWA(torch.nn.Module):
    """Packed weights and the list of needed block outputs, as in ``DenseFormerDWA``."""

    def __init__(self, n_blocks: int, dilation: int, period: int, device, dtype):
        super().__init__()
        self.steps = [i for i in range(1, n_blocks + 1) if i % period == 0]
        self.sources = {i: list(range(i % dilation, i + 1, dilation)) for i in self.steps}
        self.offsets, total = {}, 0
        for i in self.steps:
            self.offsets[i] = total
            total += len(self.sources[i])
        values = torch.zeros(total, device=device, dtype=dtype)
        for i in self.steps:
            values[self.offsets[i] + len(self.sources[i]) - 1] = 1.0
        self.alphas = torch.nn.Parameter(values)
        self.needed = {j for i in self.steps for j in self.sources[i]}

    def weights(self, i: int) -> torch.Tensor:
        return self.alphas[self.offsets[i] : self.offsets[i] + len(self.sources[i])]


def make_runner(impl: str, depth: int, dilation: int, period: int, x0: torch.Tensor,
                scales: torch.Tensor) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    """A closure running forward + backward for ``impl``; returns (run, parameters whose grads to compare)."""
    dev, dt = x0.device, x0.dtype
    if impl == "paper":
        mod = PaperDWAModules(depth, dilation, period, dev, dt)

        def run() -> torch.Tensor:
            x = x0
            mod.init_accumulators(x)
            for i in range(depth):
                x = x * scales[i]
                x = mod(x, i)
            loss = x.float().square().mean()
            loss.backward()
            return loss

        # Align the paper's per-step vectors with our packed layout for the correctness check.
        return run, [scales, *mod.alphas]

    ours = OurDWA(depth, dilation, period, dev, torch.float32)
    backend = None if impl == "none" else impl

    def run() -> torch.Tensor:
        x = x0
        outputs = {0: x} if 0 in ours.needed else {}
        for i in range(1, depth + 1):
            x = x * scales[i - 1]
            if i in ours.needed:
                outputs[i] = x
            if backend is not None and i in ours.offsets:
                ids = ours.sources[i]
                x = depth_weighted_average([outputs[j] for j in ids], ours.weights(i), backend=backend)
        loss = x.float().square().mean()
        loss.backward()
        return loss

    params = [scales] + [ours.alphas[ours.offsets[i] : ours.offsets[i] + len(ours.sources[i])] for i in ours.steps]
    run.alphas = ours.alphas  # type: ignore[attr-defined]
    return run, params


def check_same_results(runners: dict[str, tuple[Callable, list[torch.Tensor]]], depth: int, dtype: torch.dtype) -> None:
    """All DWA implementations give the same loss and parameter gradients (weights perturbed off identity)."""
    losses, grads = {}, {}
    for name, (run, params) in runners.items():
        if name == "none":
            continue
        torch.manual_seed(123)
        with torch.no_grad():  # same non-trivial weights for everyone
            for p in params[1:]:
                values = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
                values = values * 0.2 / p.numel() ** 0.5
                values[-1] += 1.0
                p.copy_(values)
        for p in params:
            p.grad = None
        if hasattr(run, "alphas"):
            run.alphas.grad = None
        losses[name] = run().item()
        if hasattr(run, "alphas"):
            g_alpha = run.alphas.grad.float().cpu()
        else:
            g_alpha = torch.cat([p.grad.float().cpu() for p in params[1:]])
        grads[name] = (params[0].grad.float().cpu(), g_alpha)
    # Each of the ~2 d roundings along the chain (block, DWA step) adds a relative error of at most u;
    # independent ones add up like a random walk, so two implementations differ by ~sqrt(2 d) u
    # (fp32: measured <= 3e-7 at d = 48; bf16: <= 0.024 loss, 0.038 gradients, against the paper's package).
    u = torch.finfo(dtype).eps / 2
    tol_loss, tol_grad = 3 * u * (2 * depth) ** 0.5, 4 * u * (2 * depth) ** 0.5
    names = list(losses)
    for name in names[1:]:
        rel = abs(losses[name] - losses[names[0]]) / max(abs(losses[names[0]]), 1e-30)
        assert rel <= tol_loss, f"d={depth}: {name} loss {losses[name]} != {names[0]} {losses[names[0]]}"
        for a, b in zip(grads[name], grads[names[0]]):
            err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            assert err <= tol_grad, f"d={depth}: {name} gradients differ from {names[0]} (rel {err:.3g})"


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured device copy bandwidth in bytes/s (read + write) for a ``nbytes`` buffer."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times)


def kernel_bandwidth(device: torch.device, dtype: torch.dtype, numel: int, ns: list[int], reps: int) -> list[dict]:
    """Fused forward / backward of one DWA with N sources: achieved bytes/s vs the copy bandwidth."""
    copy_bw = copy_bandwidth(device)
    elt = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for n in ns:
        xs = [torch.randn(numel, device=device, dtype=dtype, requires_grad=True) for _ in range(n)]
        w = torch.randn(n, device=device, requires_grad=True)
        g = torch.randn(numel, device=device, dtype=dtype)
        for backend in ("triton", "torch"):
            fwd, bwd = [], []
            for _ in range(reps + 2):
                sync(device)
                t0 = time.perf_counter()
                y = depth_weighted_average(xs, w, backend=backend)
                sync(device)
                t1 = time.perf_counter()
                torch.autograd.grad(y, [w, *xs], g)
                sync(device)
                t2 = time.perf_counter()
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
            t_f, t_b = statistics.median(fwd[2:]), statistics.median(bwd[2:])
            bytes_f, bytes_b = (n + 1) * numel * elt, (2 * n + 1) * numel * elt
            rows.append(dict(N=n, numel=numel, backend=backend, fwd_ms=t_f * 1e3, bwd_ms=t_b * 1e3,
                             fwd_bw_frac=bytes_f / t_f / copy_bw, bwd_bw_frac=bytes_b / t_b / copy_bw,
                             copy_GBps=copy_bw / 1e9))
    return rows


def main(argv: Sequence[str] | None = None) -> dict:
    """Measure, print and record (see the module docstring); returns the record."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--shape", default=None,
                        help="B,T,D of one state (default 2,256,256 on CPU, 8,2048,2048 on CUDA)")
    parser.add_argument("--depths", default="12,24,48")
    parser.add_argument("--configs", default="1x1,4x5", help="k×p DenseFormer variants")
    parser.add_argument("--reps", type=int, default=None, help="timed repeats per implementation (interleaved)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on shared machines)")
    parser.add_argument("--label", default="", help="free text stored with the record")
    parser.add_argument("--out", default=str(BENCH_DIR / "dwa.jsonl"), help="results file (appended)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if args.shape:
        shape = tuple(int(s) for s in args.shape.split(","))
    else:
        shape = (8, 2048, 2048) if device.type == "cuda" else (2, 256, 256)
    reps = args.reps or (20 if device.type == "cuda" else 5)
    impls = ["none", "paper", "reference", "torch"] + (["triton"] if triton_available(device) else [])
    timer = clock_name(device)
    load_at_start = print_header("bench_dwa", device, f"state {shape} {args.dtype}, {reps} interleaved repeats, "
                                                      "median fwd+bwd; baseline = paper")

    results = []
    header = f"{'d':>3} {'k×p':>4} | " + " | ".join(f"{name:>34}" for name in impls[1:])
    print(f"\n{'':>9}   time ms (DWA ms above 'none', ×paper [paired median]) / peak MiB (×paper)")
    print(header)
    print("-" * len(header))
    for config in args.configs.split(","):
        dilation, period = (int(v) for v in config.lower().split("x"))
        for depth in (int(d) for d in args.depths.split(",")):
            torch.manual_seed(0)
            x0 = torch.randn(shape, device=device, dtype=dtype)
            scales = torch.ones(depth, device=device, dtype=dtype, requires_grad=True)
            runners = {impl: make_runner(impl, depth, dilation, period, x0, scales) for impl in impls}
            if depth >= period:  # otherwise there is no DWA step, hence nothing to compare
                check_same_results(runners, depth, dtype)

            def timed(run: Callable[[], torch.Tensor], scales: torch.Tensor = scales) -> Callable[[], torch.Tensor]:
                def call() -> torch.Tensor:
                    scales.grad = None  # each run's gradients, not their sum over repeats
                    return run()
                return call

            times = interleave({impl: timed(runners[impl][0]) for impl in impls}, reps, device)
            med = {impl: statistics.median(t) * 1e3 for impl, t in times.items()}
            ratio = {impl: paired(times[impl], times["paper"]).as_record() for impl in impls}
            mem = {impl: peak_memory_bytes(runners[impl][0], device) / 2**20 for impl in impls}
            row = dict(depth=depth, config=f"{dilation}x{period}", time_ms=med, peak_mib=mem,
                       dwa_ms={impl: med[impl] - med["none"] for impl in impls}, ratio_vs_paper=ratio)
            results.append(row)
            cells = []
            for impl in impls[1:]:
                cells.append(f"{med[impl]:6.1f} ({med[impl] - med['none']:5.1f},{ratio[impl]['median']:4.2f}×)"
                             f" {mem[impl]:5.0f} ({mem[impl] / mem['paper']:4.2f}×)")
            print(f"{depth:>3} {dilation}x{period:<2} | " + " | ".join(cells))
    print("\n'none' (no DWA) fwd+bwd ms: " + ", ".join(f"d={r['depth']} {r['config']}: {r['time_ms']['none']:.1f} "
                                                      f"({r['peak_mib']['none']:.0f} MiB)" for r in results))

    kernel_rows = []
    if "triton" in impls:
        numel = 1
        for s in shape:
            numel *= s
        kernel_rows = kernel_bandwidth(device, dtype, numel, [2, 13, 49], reps)
        print(f"\nSingle DWA, {numel} elements {args.dtype}; copy bandwidth {kernel_rows[0]['copy_GBps']:.0f} GB/s")
        print(f"{'N':>3} {'backend':>8} | {'fwd ms':>8} {'fwd BW/copy':>11} | {'bwd ms':>8} {'bwd BW/copy':>11}")
        for r in kernel_rows:
            print(f"{r['N']:>3} {r['backend']:>8} | {r['fwd_ms']:8.3f} {r['fwd_bw_frac']:11.2f} | "
                  f"{r['bwd_ms']:8.3f} {r['bwd_bw_frac']:11.2f}")

    record = dict(record_header(device, argv, args.label, load_at_start), dtype=args.dtype, shape=list(shape),
                  reps=reps, timer=timer, threads=torch.get_num_threads(), results=results, kernel=kernel_rows)
    if not args.no_save:
        print(f"\nappended to {append_record(args.out, record)}")
    return record


if __name__ == "__main__":
    main()
