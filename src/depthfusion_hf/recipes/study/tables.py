"""The markdown reports of the two studies: per depth and model the losses and the paired differences to the
same-seed Llama at equal steps and at equal time (comparison), per model and lr scale (upcycling)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from ..clm import BASELINE
from ..records import table_lines
from .stats import PairedSummary, interpolate_curve, mean_std, paired_summary


def _pm(mean: float, std: float) -> str:
    return f"{mean:.4f}" if math.isnan(std) else f"{mean:.4f} ± {std:.4f}"


def _paired(summary: PairedSummary) -> str:
    if summary.n < 2:
        return f"{summary.mean:+.4f} (1 seed)"
    return f"{summary.mean:+.4f} [{summary.low:+.4f}, {summary.high:+.4f}]"


def model_order(records: Sequence[dict]) -> list[str]:
    """The specs in first-seen order, the Llama first."""
    specs = list(dict.fromkeys(r["spec"] for r in records))
    return sorted(specs, key=lambda s: s != BASELINE)


# clock (a curve key) -> the run's total training time by that clock
_CLOCK_TOTALS = {"seconds": "train_seconds", "cpu_seconds": "train_cpu_seconds"}


def compare_summary(records: Sequence[dict], clock: str = "seconds") -> dict[int, dict[str, dict]]:
    """Per depth and model: losses, paired statistics against the same-seed Llama, and equal-wall-clock losses.

    For each run paired with a same-seed, same-depth Llama run, ``wall`` is its loss interpolated at the Llama's
    total training seconds (``wall_reached`` False when the run finished before that budget); ``clock`` is
    ``"seconds"`` (wall-clock) or ``"cpu_seconds"`` (the process's CPU time: steadier on a shared machine).
    """
    if clock not in _CLOCK_TOTALS:
        raise ValueError(f"clock must be one of {sorted(_CLOCK_TOTALS)}; got {clock!r}")
    total = _CLOCK_TOTALS[clock]
    summary: dict[int, dict[str, dict]] = {}
    for depth in sorted({r["layers"] for r in records}):
        at_depth = [r for r in records if r["layers"] == depth]
        llama = {r["seed"]: r for r in at_depth if r["spec"] == BASELINE}
        rows = {}
        for spec in model_order(at_depth):
            runs = sorted((r for r in at_depth if r["spec"] == spec), key=lambda r: r["seed"])
            row: dict[str, Any] = dict(
                name=runs[0]["name"], seeds=[r["seed"] for r in runs], losses=[r["eval_loss"] for r in runs],
                parameters=runs[0]["parameters"],
                tokens_per_second=statistics.fmean(r["tokens_per_second"] for r in runs),
                train_seconds=statistics.fmean(r["train_seconds"] for r in runs),
                train_cpu_seconds=statistics.fmean(r["train_cpu_seconds"] for r in runs),
            )
            paired = [(r, llama[r["seed"]]) for r in runs if r["seed"] in llama]
            if paired and spec != BASELINE:
                row["diffs"] = [r["eval_loss"] - base["eval_loss"] for r, base in paired]
                row["paired"] = paired_summary(row["diffs"])
                walls = [interpolate_curve(r["curve"], base[total], clock) for r, base in paired]
                base_walls = [interpolate_curve(base["curve"], base[total], clock)[0] for _, base in paired]
                row["wall"] = [w for w, _ in walls]
                row["wall_reached"] = [reached for _, reached in walls]
                row["wall_diffs"] = [w - b for w, b in zip(row["wall"], base_walls)]
                row["wall_paired"] = paired_summary(row["wall_diffs"])
            rows[spec] = row
        summary[depth] = rows
    return summary


def compare_tables(records: Sequence[dict], title: str = "", clock: str = "seconds") -> str:
    """The markdown report of a comparison: one table per depth (see ``scripts/compare_families.py``); the equal-time
    columns use ``clock`` (``"seconds"``: wall-clock, ``"cpu_seconds"``: CPU time, see :func:`compare_summary`)."""
    budget = "wall-clock" if clock == "seconds" else "CPU time"
    lines = [f"# {title}" if title else "# Family comparison", ""]
    lines += ["Δ: paired difference to the Llama of the same seed and depth (negative = lower loss than the Llama), "
              f"mean [95 % t-interval]; won: seeds with Δ < 0. Equal {budget}: each run's validation-loss curve "
              f"interpolated at the same-seed Llama's training {budget} (evaluation excluded); * marks runs that "
              "finished before that budget (their final loss is used). Train tokens/s and train s: wall-clock; "
              "CPU s: the process's CPU time.", ""]
    header = ["model", "seeds", "val loss (mean ± std)", "Δ at equal steps", "won", f"Δ at equal {budget}", "won",
              "params", "train tokens/s", "train s", "CPU s"]
    for depth, rows in compare_summary(records, clock).items():
        table = []
        for spec, row in rows.items():
            delta = ["—"] * 4
            if "paired" in row:
                paired, wall = row["paired"], row["wall_paired"]
                star = "*" if not all(row["wall_reached"]) else ""
                delta = [_paired(paired), f"{paired.won}/{paired.n}", _paired(wall) + star, f"{wall.won}/{wall.n}"]
            table.append([spec, len(row["seeds"]), _pm(*mean_std(row["losses"])), *delta, f"{row['parameters']:,}",
                          f"{row['tokens_per_second']:,.0f}", f"{row['train_seconds']:.1f}",
                          f"{row['train_cpu_seconds']:.1f}"])
        lines += [f"## {depth} layers", "", *table_lines(header, table), "",
                  *mean_curve_table([r for r in records if r["layers"] == depth], list(rows)), ""]
    return "\n".join(lines)


def mean_curve_table(records: Sequence[dict], specs: Sequence[str]) -> list[str]:
    """Markdown lines: validation loss at every evaluated step, mean over each spec's runs in ``records``."""
    steps = sorted({p["step"] for r in records for p in r["curve"]})
    table = []
    for spec in specs:
        values = [[p["eval_loss"] for r in records if r["spec"] == spec for p in r["curve"] if p["step"] == step]
                  for step in steps]
        table.append([spec, *(f"{statistics.fmean(v):.4f}" if v else "" for v in values)])
    return ["Validation loss along the way (mean over seeds):", "",
            *table_lines(["model", *(f"step {s}" for s in steps)], table)]


def continuation_summary(records: Sequence[dict]) -> dict[tuple[str, float], dict]:
    """Per (spec, lr scale): final validation / test losses and the paired difference to the continued Llama."""
    llama = {r["seed"]: r for r in records if r["spec"] == BASELINE}
    out = {}
    for spec in model_order(records):
        for scale in sorted({r["lr_scale"] for r in records if r["spec"] == spec}):
            runs = sorted((r for r in records if r["spec"] == spec and r["lr_scale"] == scale), key=lambda r: r["seed"])
            row: dict[str, Any] = dict(name=runs[0]["name"], seeds=[r["seed"] for r in runs],
                                       losses=[r["eval_loss"] for r in runs],
                                       start=[r["curve"][0]["eval_loss"] for r in runs],
                                       test=[r.get("test_loss", r["extra"].get("test_loss")) for r in runs],
                                       parameters=runs[0]["parameters"])
            paired = [(r, llama[r["seed"]]) for r in runs if r["seed"] in llama]
            if paired and spec != BASELINE:
                row["paired"] = paired_summary([r["eval_loss"] - b["eval_loss"] for r, b in paired])
            out[(spec, scale)] = row
    return out


def best_scales(records: Sequence[dict]) -> dict[str, float]:
    """Per upcycled spec: the new-parameter lr scale with the lowest mean **validation** loss."""
    best: dict[str, tuple[float, float]] = {}
    for (spec, scale), row in continuation_summary(records).items():
        if spec == BASELINE:
            continue
        loss = statistics.fmean(row["losses"])
        if spec not in best or loss < best[spec][0]:
            best[spec] = (loss, scale)
    return {spec: scale for spec, (_, scale) in best.items()}


def continuation_tables(records: Sequence[dict], title: str = "") -> str:
    """The markdown report of the upcycling study: every (model, lr scale), the validation-chosen scale marked."""
    chosen = best_scales(records)
    lines = [f"# {title}" if title else "# Upcycling: continued pre-training", "",
             "Δ: paired difference to the continued Llama of the same seed (validation split), mean [95 % "
             "t-interval]. The new-parameter lr scale is chosen per model on the validation loss (✓); the test "
             "loss is reported, never used to choose.", ""]
    table = []
    for (spec, scale), row in continuation_summary(records).items():
        mark = " ✓" if chosen.get(spec) == scale else ""
        paired = row.get("paired")
        delta = [_paired(paired), f"{paired.won}/{paired.n}"] if paired else ["—", "—"]
        tests = [t for t in row["test"] if t is not None]
        table.append([spec, f"{scale:g}{mark}", len(row["seeds"]), f"{statistics.fmean(row['start']):.4f}",
                      _pm(*mean_std(row["losses"])), *delta, _pm(*mean_std(tests)) if tests else "—",
                      f"{row['parameters']:,}"])
    lines += [*table_lines(["model", "new-param lr scale", "seeds", "val loss at step 0", "val loss (mean ± std)",
                            "Δ val", "won", "test loss (mean ± std)", "params"], table), ""]
    chosen_runs = [r for r in records if r["lr_scale"] == (1.0 if r["spec"] == BASELINE else chosen[r["spec"]])]
    lines += ["At the chosen lr scales:", "", *mean_curve_table(chosen_runs, model_order(records)), ""]
    return "\n".join(lines)

__all__ = ["best_scales", "compare_summary", "compare_tables", "continuation_summary", "continuation_tables",
           "mean_curve_table", "model_order"]
