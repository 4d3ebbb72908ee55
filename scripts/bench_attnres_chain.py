#!/usr/bin/env python
"""The AttnRes op alone on a model's read pattern: another checkout's op against the current one.

A full-AttnRes model of ``--sublayers`` sub-layers makes that many calls, call j reading the sources
v_0..v_j ([batch, seq, D] each, all live at once, as in the model). This script times forward + backward of
exactly those calls (gradients of every query, norm weight and source), without the rest of the model, for

- ``before``: the ``attention_residual_with_backend`` of ``--before`` (a checkout or its ``models/attnres``
  folder), torch backend;
- ``now``: the current op, each call computing its sources' norms;
- ``now-cached``: the current op with each source's inverse norm computed once (``source_inv_rms``) and passed
  to every call reading it, as the model does in training.

Interleaved repeats (order reversed every other repeat), process CPU time, medians and [min, max] of the
ratios to ``before``; appended to ``docs/bench/attnres_chain.jsonl`` with the command.

    python scripts/bench_attnres_chain.py --before /tmp/old --reps 7
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attnres_ab import load_attnres_folder  # noqa: E402
from bench_common import git_commit, machine_name  # noqa: E402

from depthfusion_hf.models.attnres import attnres as current  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a checkout (or its models/attnres folder)")
    parser.add_argument("--sublayers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=str(REPO / "docs" / "bench" / "attnres_chain.jsonl"))
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = load_attnres_folder(Path(args.before)).attnres

    gen = torch.Generator().manual_seed(0)
    n = args.sublayers
    sources = [torch.randn(args.batch, args.seq, args.dim, generator=gen).requires_grad_() for _ in range(n + 1)]
    queries = [(torch.randn(args.dim, generator=gen) / args.dim**0.5).requires_grad_() for _ in range(n)]
    weights = [(1 + 0.1 * torch.randn(args.dim, generator=gen)).requires_grad_() for _ in range(n)]
    grads = [torch.randn(args.batch, args.seq, args.dim, generator=gen) for _ in range(n)]

    def run(mode: str) -> tuple[float, list[torch.Tensor]]:
        start = time.process_time()
        norms = [current.source_inv_rms(v, 1e-6) for v in sources] if mode == "now-cached" else None
        outs = []
        for j in range(n):
            reads = sources[: j + 2]
            if mode == "before":
                outs.append(before.attention_residual_with_backend(queries[j], reads, weights[j], 1e-6, False, "torch"))
            else:
                outs.append(current.attention_residual_with_backend(
                    queries[j], reads, weights[j], 1e-6, False, "torch", norms[: j + 2] if norms else None))
        result = torch.autograd.grad(outs, sources + queries + weights, grads)
        return time.process_time() - start, result

    modes = ["before", "now", "now-cached"]
    reference = run("before")[1]
    gates = {}
    for mode in modes[1:]:  # same function: every gradient within 64 eps sqrt(n) relative in norm of before's
        eps = torch.finfo(torch.float32).eps
        worst = max(((a - b).norm() / b.norm() / (64 * eps * b.numel() ** 0.5)).item()
                    for a, b in zip(run(mode)[1], reference))
        assert worst <= 1, f"{mode}: a gradient differs from before's beyond the gate ({worst:.2f} of it)"
        gates[mode] = worst
    times = {m: [] for m in modes}
    for rep in range(args.reps):
        for mode in modes if rep % 2 == 0 else reversed(modes):
            times[mode].append(run(mode)[0] * 1e3)
    print(f"# bench_attnres_chain  {machine_name(torch.device('cpu'))}  torch {torch.__version__}  commit "
          f"{git_commit()}: {n} calls reading 2..{n + 1} sources of [{args.batch}, {args.seq}, {args.dim}], fp32, "
          f"fwd+bwd, {args.reps} reps; worst gradient at {max(gates.values()):.0%} of its gate")
    results = []
    for mode in modes:
        ratios = [a / b for a, b in zip(times[mode], times["before"])]
        print(f"{mode:>11} {statistics.median(times[mode]):8.1f} ms  ×{statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}] of before")
        results.append(dict(mode=mode, ms=times[mode], ratio_median=statistics.median(ratios), ratios=ratios))
    if not args.no_save:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                      machine=machine_name(torch.device("cpu")), command="python " + " ".join(sys.argv),
                      torch=torch.__version__, commit=git_commit(), args=vars(args), gates=gates, results=results)
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"appended to {out}")


if __name__ == "__main__":
    main()
