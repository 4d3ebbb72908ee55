"""Figures of the family studies (``recipes/study/``): validation loss against steps with seed bands, and the
paired final Δ-loss against depth per family."""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .plotting import agg_pyplot, save_figure
from .recipes.study.tables import compare_summary, model_order


def plot_loss_curves(records: Sequence[dict], path: str | Path, title: str, include_start: bool = False) -> Path:
    """Validation loss against steps, one line per spec (mean over seeds) with a band of ± one std over seeds.

    ``records``: runs with ``spec``, ``seed`` and ``curve`` (``[{"step", "eval_loss"}]``), e.g. one depth's runs.
    The y-axis covers the evaluations after step 0, or all of them with ``include_start`` (continued training,
    where step 0 is the upcycled model).
    """
    plt = agg_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec in model_order(records):
        curves = [r["curve"] for r in records if r["spec"] == spec]
        steps = sorted({p["step"] for c in curves for p in c})
        values = [[p["eval_loss"] for c in curves for p in c if p["step"] == step] for step in steps]
        means = np.array([statistics.fmean(v) for v in values])
        stds = np.array([statistics.stdev(v) if len(v) > 1 else 0.0 for v in values])
        line, = ax.plot(steps, means, label=f"{spec} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
        ax.fill_between(steps, means - stds, means + stds, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token)")
    losses = [p["eval_loss"] for r in records for p in r["curve"] if include_start or p["step"] > 0]
    if losses:  # the step-0 loss (about ln V) would squash the rest
        ax.set_ylim(min(losses) - 0.05, max(losses) + 0.05)
    return _finish(fig, ax, title, path)


def plot_delta_vs_depth(records: Sequence[dict], path: str | Path, title: str) -> Path:
    """Final paired Δ validation loss to the same-seed Llama against depth, one line per spec, 95 % t-intervals
    as error bars (none for one seed)."""
    plt = agg_pyplot()
    summary = compare_summary(records)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    specs = [s for s in model_order(records) if s != "llama"]
    for spec in specs:
        depths, means, errors = [], [], []
        for depth, rows in summary.items():
            paired = rows.get(spec, {}).get("paired")
            if paired is None:
                continue
            depths.append(depth)
            means.append(paired.mean)
            errors.append(0.0 if paired.n < 2 else paired.high - paired.mean)
        if depths:
            ax.errorbar(depths, means, yerr=errors, marker="o", capsize=4, label=spec)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xlabel("layers")
    ax.set_xticks(sorted(summary))
    ax.set_ylabel("Δ val loss vs Llama (paired; < 0 is better)")
    return _finish(fig, ax, title, path)


def _finish(fig, ax, title: str, path: str | Path) -> Path:
    """The title (wrapped at 70 characters), legend and grid of a study figure; saves it to ``path``."""
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


__all__ = ["plot_delta_vs_depth", "plot_loss_curves"]
