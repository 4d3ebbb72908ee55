#!/usr/bin/env python
"""Where an AttnRes train step's time goes next to the same-shape Llama's (bench_models.py's shape and seed).

Per model: user and system CPU time and minor page faults of ``--steps`` train steps (``os.times``,
``getrusage``; system time is mostly page faults of fresh allocations), then ``--profile-steps`` profiled steps
(``torch.profiler``) whose operators are summed by name (``--by-shape``: by name and input shapes) and listed
next to Llama's: the difference per operator is what the AttnRes model adds (or removes). Caveat measured here:
under the profiler, operators that allocate their output run several times slower than without it, so the
profile misplaces time; ``ablate_attnres_step.py`` measures pieces without it.

    python scripts/profile_attnres_step.py --models llama,attnres-block8 --steps 5
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import build_models, make_train_step  # noqa: E402


def op_totals(step, by_shape: bool, steps: int) -> dict[str, tuple[float, int]]:
    """Self CPU ms and call count per step of every operator (by name, or name and input shapes), over ``steps``
    profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=by_shape) as prof:
        for _ in range(steps):
            step()
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for ev in prof.key_averages(group_by_input_shape=by_shape):
        key = f"{ev.key} {ev.input_shapes}" if by_shape else ev.key
        totals[key][0] += ev.self_cpu_time_total / 1e3 / steps
        totals[key][1] += ev.count // steps
    return {k: (v[0], v[1]) for k, v in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama,attnres-block8")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--by-shape", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=3)
    args = parser.parse_args()
    ns = argparse.Namespace(layers=12, hidden=256, intermediate=704, vocab=8192, seq=256, batch=4, kv_heads=None,
                            attn="sdpa", window=4, before=None, models=args.models)
    torch.set_num_threads(1)
    models = build_models(ns, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, ns.vocab, (ns.batch, ns.seq), generator=gen)
    batch = {"input_ids": ids, "labels": ids}
    steps = {n: make_train_step(m, batch) for n, m in models.items()}
    for step in steps.values():
        step()
    times: dict[str, list] = {n: [] for n in models}
    order = list(models)
    for rep in range(args.steps):
        for name in order if rep % 2 == 0 else reversed(order):
            f0, t0, c0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, os.times(), time.process_time()
            steps[name]()
            f1, t1, c1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, os.times(), time.process_time()
            times[name].append((c1 - c0, t1.user - t0.user, t1.system - t0.system, f1 - f0))
    base = order[0]
    for name in order:
        cpu = sorted(t[0] for t in times[name])[len(times[name]) // 2]
        user = sum(t[1] for t in times[name]) / len(times[name])
        system = sum(t[2] for t in times[name]) / len(times[name])
        faults = sum(t[3] for t in times[name]) // len(times[name])
        ratios = sorted(a[0] / b[0] for a, b in zip(times[name], times[base]))
        print(f"{name:>16}: cpu {cpu * 1e3:7.1f} ms (median)  user {user * 1e3:7.1f}  sys {system * 1e3:6.1f} ms "
              f"(means)  {faults} minor faults  × {base}: {ratios[len(ratios) // 2]:.3f} "
              f"[{ratios[0]:.3f}, {ratios[-1]:.3f}]")
    if args.no_profile:
        return
    totals = {n: op_totals(steps[n], args.by_shape, args.profile_steps) for n in order}
    for name in order[1:]:
        keys = set(totals[name]) | set(totals[base])
        diff = sorted(keys, key=lambda k: -abs(totals[name].get(k, (0, 0))[0] - totals[base].get(k, (0, 0))[0]))
        t_all, b_all = sum(v[0] for v in totals[name].values()), sum(v[0] for v in totals[base].values())
        print(f"\n--- {name} vs {base}: profiled self CPU {t_all:.1f} vs {b_all:.1f} ms; largest differences ---")
        for k in diff[: args.rows]:
            a, b = totals[name].get(k, (0.0, 0)), totals[base].get(k, (0.0, 0))
            print(f"{a[0] - b[0]:+8.2f} ms  {a[0]:8.2f} ({a[1]:5d})  {b[0]:8.2f} ({b[1]:5d})  {k[:150]}")


if __name__ == "__main__":
    main()
