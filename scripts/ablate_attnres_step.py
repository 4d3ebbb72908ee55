#!/usr/bin/env python
"""Ablations of an AttnRes train step (bench_models.py's shape and seed), interleaved with the same-shape Llama.

Each variant swaps a piece of the AttnRes model for something cheaper (not the same function: for timing only)
and is timed against Llama in one process (process CPU time, 1 thread, interleaved repeats, the order reversed
every other repeat); the gaps between variants say what each piece costs inside the model:

- ``current``: the model as it is;
- ``sum-mix``: every call a plain sum of its sources (autograd), the logit rows still computed;
- ``sum``: every call a plain sum of its sources, no logit rows;
- ``last``: every call returns its last source (the sources are kept but not read).

    python scripts/ablate_attnres_step.py --block-size 3 --reps 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import build_models, make_train_step  # noqa: E402

from depthfusion_hf.models.attnres import modeling_attnres  # noqa: E402

VARIANTS = ("current", "sum-mix", "sum", "last")
MODE = {"v": "current"}


def patch() -> None:
    """Route the model's calls through ``MODE["v"]``."""
    original_rows = modeling_attnres.uses_logit_rows
    original_forward = modeling_attnres.AttnResMix.forward

    def uses_logit_rows(backend, source):
        return MODE["v"] in ("current", "sum-mix") and original_rows(backend, source)

    def forward(self, sources, backend=None, return_weights=False, inv_rms=None, logit_rows=None):
        if MODE["v"] in ("sum-mix", "sum"):
            h = sources[0]
            for v in sources[1:]:
                h = h + v
            return h
        if MODE["v"] == "last":
            return sources[-1]
        return original_forward(self, sources, backend, return_weights, inv_rms, logit_rows)

    modeling_attnres.uses_logit_rows = uses_logit_rows
    modeling_attnres.AttnResMix.forward = forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=3, help="attnres_block_size (1 = full)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    ns = argparse.Namespace(layers=12, hidden=256, intermediate=704, vocab=8192, seq=256, batch=4, kv_heads=None,
                            attn="sdpa", window=4, before=None,
                            models="llama,attnres-full" if args.block_size == 1 else "llama,attnres-block8")
    torch.set_num_threads(1)
    patch()
    models = build_models(ns, torch.device("cpu"), torch.float32)
    if args.block_size not in (1, 3):
        raise SystemExit("--block-size: 1 (full) or 3 (block8)")
    attnres = models[ns.models.split(",")[1]]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, ns.vocab, (ns.batch, ns.seq), generator=gen)
    batch = {"input_ids": ids, "labels": ids}
    llama_step, attnres_step = make_train_step(models["llama"], batch), make_train_step(attnres, batch)
    variants = args.variants.split(",")

    def run(name: str) -> float:
        MODE["v"] = name
        t0 = time.process_time()
        if name == "llama":
            llama_step()
        else:
            attnres_step()
        return time.process_time() - t0

    order = ["llama", *variants]
    for name in order:
        run(name)
    times = {n: [] for n in order}
    for rep in range(args.reps):
        for name in order if rep % 2 == 0 else reversed(order):
            times[name].append(run(name))
    print(f"# block size {args.block_size}, {args.reps} reps: median ms, median [min, max] of paired ratios vs llama")
    for name in order:
        ratios = [a / b for a, b in zip(times[name], times["llama"])]
        print(f"{name:>10} {statistics.median(times[name]) * 1e3:8.1f} ms  ×{statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}]")


if __name__ == "__main__":
    main()
