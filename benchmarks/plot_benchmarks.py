#!/usr/bin/env python
"""Plot the benchmark records in ``docs/bench/*.jsonl`` as PNGs for ``docs/BENCHMARKS.md``.

The benchmark scripts append one JSON object per run to

- ``dwa.jsonl``            (``bench_dwa.py``)            -> ``dwa.png``
- ``models.jsonl``         (``bench_models.py``)         -> ``models.png``
- ``moda_attention.jsonl`` (``bench_moda_attention.py``) -> ``moda_attention.png``
- ``moda_stream.jsonl``    (``bench_models.py``, MoDA variants)  -> ``moda_stream.png``
- ``moda_layers.jsonl``    (``bench_models.py`` per ``--layers``) -> ``moda_layers.png``

For each kind this script takes the latest record (or the latest one whose commit starts with
``--commit``) and draws:

- **dwa**: forward+backward time and peak memory of each implementation relative to the paper's
  accumulator + ``tensordot`` baseline (= 1), one group of bars per implementation, one bar per
  depth and k×p;
- **models**: train-step time, peak memory and decode tok/s relative to Llama, with the bounds drawn over the
  bars they apply to: a record that stores its ``targets`` (today's ``bench_models.py``) shows the medians of
  the paired ratios against its own bounds; an older one the fastest repeat (median as a dot) against the
  issue-5/10 targets (DenseFormer 4×5 train ≤ 1.03, 1×1 ≤ 1.10, decode ≥ 0.95; MoDA train ≤ 1.15);
- **moda_attention**: time and peak-memory ratio of MoDA attention vs SDPA over the sequence length T,
  one line per depth L (M = 2L depth entries), forward and forward+backward;
- **moda_stream**: the MoDA variants of issue 10 (median of the paired per-repeat ratios vs Llama,
  whiskers: their min and max) with the issue's targets (train ≤ 1.15 / 1.06 without FFN K/V, peak
  ≤ 1.25, decode ≥ 0.90);
- **moda_layers**: train-step and peak-memory ratio vs Llama over the depth L, before and after,
  from every record of the latest commit in the file (one per ``--layers`` run).

Titles name the machine, torch version, commit and date of the record. A kind whose file is
missing, empty or has no record for ``--commit`` is skipped with a message on stderr, and the exit
status is then 1 (the other plots are still written).

    python benchmarks/plot_benchmarks.py                    # latest records -> docs/bench/*.png
    python benchmarks/plot_benchmarks.py --commit f0bde0c --out /tmp/plots
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "docs" / "bench"
KINDS = ("dwa", "models", "moda_attention", "moda_stream", "moda_layers")

# The targets of records made before bench_models.py stored its own (issues 5 and 10), ratios vs Llama:
# (model-name prefix, bound, label). A record with ``targets`` is drawn with those, by exact model name.
TRAIN_TARGETS = [("denseformer-4x5", 1.03, "≤ 1.03"), ("denseformer-1x1", 1.10, "≤ 1.10"), ("moda", 1.15, "≤ 1.15")]
DECODE_TARGETS = [("denseformer", 0.95, "≥ 0.95")]


def recorded_targets(record: dict, metric: str) -> list[tuple[str, float, str]] | None:
    """``(model, bound, label)`` of ``metric`` from the record's own ``targets`` (exact names), or ``None`` when the
    record has none (an older record: the prefix tables above apply)."""
    if "targets" not in record:
        return None
    sign = "≥" if metric.startswith("decode") else "≤"
    return [(name, bounds[metric], f"{sign} {bounds[metric]}") for name, bounds in record["targets"].items()
            if metric in bounds]


class NoRecord(LookupError):
    """No usable record of a kind (file missing or empty, or no record for the requested commit)."""


def load_record(path: Path, commit: str | None = None) -> dict:
    """Return the last record in the JSON-lines file ``path`` (whose commit starts with ``commit``, if given).

    Raises :class:`NoRecord` with a readable reason when the file is missing, has no record with
    results, or none for that commit.
    """
    if not path.is_file():
        raise NoRecord(f"{path} does not exist")
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise NoRecord(f"{path}:{n} is not valid JSON ({e})") from e
    records = [r for r in records if r.get("results")]
    if not records:
        raise NoRecord(f"{path} has no record with results")
    if commit:
        matching = [r for r in records if str(r.get("commit", "")).startswith(commit)]
        if not matching:
            have = ", ".join(sorted({str(r.get("commit")) for r in records}))
            raise NoRecord(f"{path} has no record for commit {commit} (has: {have})")
        records = matching
    return records[-1]


def describe(record: dict) -> str:
    """One line naming the machine, torch, commit and date of a record (for plot titles)."""
    device = record.get("device") or record.get("args", {}).get("device", "?")
    return (f"{record.get('machine', '?')}, {device}, torch {record.get('torch', '?')}, "
            f"commit {record.get('commit', '?')}, {record.get('date', '?')}")


def _finish(fig: plt.Figure, title: str, record: dict, out: Path) -> Path:
    fig.suptitle(f"{title}\n{describe(record)}", fontsize=11)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_dwa(record: dict, out: Path) -> Path:
    """Bar chart of DWA time and peak memory relative to the ``paper`` baseline; writes ``out``."""
    rows = record["results"]
    impls = [i for i in rows[0]["time_ms"] if i != "paper"]
    impls = [i for i in impls if i != "none"] + (["none"] if "none" in impls else [])  # the floor last
    configs = sorted({r["config"] for r in rows}, key=lambda c: tuple(int(x) for x in c.split("x")))
    depths = sorted({r["depth"] for r in rows})
    cmaps = [plt.get_cmap(n) for n in ("Blues", "Oranges", "Greens", "Purples")]
    series = []  # (row, label, colour), grouped by config, shaded by depth
    for ci, config in enumerate(configs):
        for di, depth in enumerate(depths):
            row = next((r for r in rows if r["config"] == config and r["depth"] == depth), None)
            if row is not None:
                shade = 0.45 + 0.45 * di / max(len(depths) - 1, 1)
                series.append((row, f"d={depth} {config}", cmaps[ci % len(cmaps)](shade)))

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), layout="constrained")
    width = 0.8 / len(series)
    for ax, key, name in ((axes[0], "time_ms", "forward+backward time"), (axes[1], "peak_mib", "peak memory")):
        for si, (row, label, colour) in enumerate(series):
            xs = [ii + (si - (len(series) - 1) / 2) * width for ii in range(len(impls))]
            ys = [row[key][i] / row[key]["paper"] if i in row[key] else float("nan") for i in impls]
            ax.bar(xs, ys, width, color=colour, label=label, edgecolor="black", linewidth=0.3)
        ax.axhline(1.0, color="red", linestyle="--", linewidth=1, label="paper baseline (accumulator + tensordot)")
        ax.set_xticks(range(len(impls)), [("none (no DWA)" if i == "none" else i) for i in impls])
        ax.set_ylabel(f"{name} ÷ paper baseline")
        ax.set_title(f"{name} (lower is better)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 7), fontsize=9, frameon=False)
    shape = "×".join(str(s) for s in record.get("shape", []))
    return _finish(fig, f"DWA over a k×p DenseFormer of d blocks, fwd+bwd (state {shape} {record.get('dtype', '')}, "
                   f"median of {record.get('reps', '?')}, {record.get('timer', '')})", record, out)


def _targets_for(models: list[str], targets: list[tuple[str, float, str]],
                 exact: bool = False) -> list[tuple[int, float, str]]:
    found = []
    for xi, m in enumerate(models):
        for prefix, bound, label in targets:
            if m == prefix or (not exact and m.startswith(prefix)):
                found.append((xi, bound, label))
                break
    return found


def _merge_segments(found: list[tuple[int, float, str]]) -> list[tuple[int, int, float, str]]:
    """Join targets with the same bound on neighbouring bars into one segment ``(x0, x1, bound, label)``."""
    merged: list[tuple[int, int, float, str]] = []
    for xi, bound, label in found:
        if merged and merged[-1][1] == xi - 1 and merged[-1][2] == bound:
            merged[-1] = (merged[-1][0], xi, bound, label)
        else:
            merged.append((xi, xi, bound, label))
    return merged


def plot_models(record: dict, out: Path) -> Path:
    """Bar charts of train-step time, peak memory and decode speed relative to Llama; writes ``out``."""
    rows = record["results"]
    models = [r["model"] for r in rows]
    exact = "targets" in record
    if exact:  # a record of today's bench_models.py: medians of the paired ratios, its own bounds
        panels = [
            ("train_ratio_paired_median", None, "train step time ÷ Llama\n(median of paired ratios)",
             "train step (lower is better)", recorded_targets(record, "train")),
            ("peak_ratio", None, "peak memory ÷ Llama", "peak memory (lower is better)",
             recorded_targets(record, "peak")),
            ("decode_ratio_paired_median", None, "decode tok/s ÷ Llama\n(median of paired ratios)",
             "decode, batch 1 (higher is better)", recorded_targets(record, "decode")),
        ]
    else:
        panels = [
            ("train_ratio", "train_ratio_median", "train step time ÷ Llama\n(bar: fastest repeat, dot: median)",
             "train step (lower is better)", TRAIN_TARGETS),
            ("peak_ratio", None, "peak memory ÷ Llama", "peak memory (lower is better)", []),
            ("decode_ratio", "decode_ratio_median", "decode tok/s ÷ Llama\n(bar: best, dot: median)",
             "decode, batch 1 (higher is better)", DECODE_TARGETS),
        ]
    colours = ["#888888" if m.startswith("llama") else "#1f77b4" if m.startswith("denseformer") else "#2ca02c"
               for m in models]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.6), layout="constrained")
    xs = range(len(models))
    for ax, (key, median_key, ylabel, title, targets) in zip(axes, panels):
        ys = [r.get(key, float("nan")) for r in rows]
        top = max([y for y in ys if y == y] + [b for _, b, _ in targets]) * 1.1
        low = max(0.0, min([y for y in ys if y == y] + [b for _, b, _ in targets]) - 0.25)
        ax.set_ylim(low, top)
        ax.bar(xs, ys, 0.7, color=colours, edgecolor="black", linewidth=0.3)
        for x, y in zip(xs, ys):  # values inside the bars, clear of the target lines and median dots
            ax.text(x, low + 0.02 * (top - low), f"{y:.3f}", ha="center", va="bottom", rotation=90, fontsize=8,
                    color="white", fontweight="bold")
        if median_key and any(median_key in r for r in rows):
            ax.plot(xs, [r.get(median_key, float("nan")) for r in rows], "o", color="black", markersize=4,
                    label="median")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlim(-0.6, len(models) - 0.4 + (0.9 if targets else 0))  # room for target labels on the right
        for x0, x1, bound, label in _merge_segments(_targets_for(models, targets, exact)):
            ax.hlines(bound, x0 - 0.45, x1 + 0.45, colors="red", linestyles="--", linewidth=1.5)
            ax.text(x1 + 0.5, bound, f"target {label}", ha="left", va="center", fontsize=8, color="red",
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1))
        ax.set_xticks(list(xs), models, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    args = record.get("args", {})
    cfg = (f"{args.get('layers', '?')} layers, hidden {args.get('hidden', '?')}, batch {args.get('batch', '?')} × "
           f"seq {args.get('seq', '?')}, {args.get('dtype', '?')}, attn {args.get('attn', '?')}")
    return _finish(fig, f"Models vs Llama ({cfg}); red dashes: the {'recorded bounds' if exact else 'issue targets'}",
                   record, out)


def plot_moda_attention(record: dict, out: Path) -> Path:
    """Line plots of MoDA attention time and memory ÷ SDPA over T, per depth L, fwd and fwd+bwd; writes ``out``."""
    rows = record["results"]
    modes = [m for m in ("fwd", "fwd+bwd") if any(r["mode"] == m for r in rows)]
    backends = sorted({b for r in rows for b in r["time_ms"] if b != "sdpa"})
    depths = sorted({r["L"] for r in rows})
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v"]
    fig, axes = plt.subplots(2, len(modes), figsize=(6 * len(modes), 8.5), squeeze=False, layout="constrained")
    for col, mode in enumerate(modes):
        for row_i, (key, name) in enumerate((("time_ms", "time"), ("peak_mib", "peak memory"))):
            ax = axes[row_i][col]
            ratios = []
            for bi, backend in enumerate(backends):
                for li, L in enumerate(depths):
                    pts = sorted((r["T"], r[key][backend] / r[key]["sdpa"]) for r in rows
                                 if r["mode"] == mode and r["L"] == L and backend in r[key] and r[key]["sdpa"] > 0)
                    if not pts:
                        continue
                    ratios += [p[1] for p in pts]
                    M = next(r["M"] for r in rows if r["L"] == L)
                    label = f"L={L} (M={M})" + (f", {backend}" if len(backends) > 1 else "")
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[bi % len(styles)],
                            marker=markers[li % len(markers)], label=label)
            ax.axhline(1.0, color="red", linestyle="--", linewidth=1, label="SDPA (no depth)")
            ax.set_xscale("log", base=2)
            Ts = sorted({r["T"] for r in rows})
            ax.set_xticks(Ts, [str(t) for t in Ts])
            ax.minorticks_off()
            if ratios and max(ratios) / max(min(ratios), 1e-9) > 20:
                ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel(f"{name} ÷ SDPA")
            ax.set_title(f"{mode}: {name} (lower is better)", fontsize=10)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 5), fontsize=9, frameon=False)
    shape = ", ".join(f"{k}={record.get(k, '?')}" for k in ("B", "Hq", "Hkv", "d"))
    return _finish(fig, f"MoDA attention ({', '.join(backends)}) vs SDPA ({shape}, {record.get('dtype', '')}, "
                   f"median of {record.get('reps', '?')})", record, out)




MODA_TARGETS = {"moda": {"train": 1.15, "peak": 1.25, "decode": 0.90},
                "moda-noffn": {"train": 1.06, "peak": 1.25, "decode": 0.90}}


def _paired(row: dict, metric: str) -> tuple[float, float, float]:
    """(median, min, max) of a model's paired per-repeat ratios vs Llama (peak memory: one value)."""
    if metric == "peak":
        return (row["peak_ratio"],) * 3
    values = row[f"{metric}_ratio_paired_all"]
    return row[f"{metric}_ratio_paired_median"], min(values), max(values)


def plot_moda_stream(record: dict, out: Path) -> Path:
    """MoDA variants vs Llama: train, peak memory, decode, with whiskers and the issue-10 targets; writes ``out``."""
    rows = record["results"]
    models = [r["model"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.6), layout="constrained")
    colours = ["#888888" if m.startswith("llama") else "#d62728" if "before" in m else "#2ca02c" for m in models]
    for ax, metric, title in zip(axes, ("train", "peak", "decode"),
                                 ("train step ÷ Llama (lower is better)", "peak memory ÷ Llama (lower is better)",
                                  "decode tok/s ÷ Llama (higher is better)")):
        stats = [_paired(r, metric) for r in rows]
        ys = [m for m, _, _ in stats]
        err = [[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]]
        ax.bar(range(len(models)), ys, 0.7, color=colours, edgecolor="black", linewidth=0.3, yerr=err, capsize=3)
        for x, y in enumerate(ys):
            ax.text(x, 0.03, f"{y:.3f}", ha="center", va="bottom", rotation=90, fontsize=8, color="white",
                    fontweight="bold")
        for x, model in enumerate(models):
            bound = MODA_TARGETS.get(model, {}).get(metric)
            if bound is not None:
                ax.hlines(bound, x - 0.45, x + 0.45, colors="red", linestyles="--", linewidth=1.5)
                ax.text(x, bound, f"{bound}", ha="center", va="bottom", fontsize=7, color="red")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(models)), models, rotation=35, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    args = record.get("args", {})
    cfg = (f"{args.get('layers', '?')} layers, hidden {args.get('hidden', '?')}, batch {args.get('batch', '?')} × "
           f"seq {args.get('seq', '?')}, {args.get('dtype', '?')}; bars: median of paired ratios, whiskers: min-max")
    return _finish(fig, f"MoDA depth stream vs Llama ({cfg}); red: issue 10 targets", record, out)


def load_sweep(path: Path, commit: str | None = None) -> list[dict]:
    """The latest sweep in ``path``: walking back from the last record (of ``commit``, if given) with the same
    label, every record until a layer count repeats; sorted by layer count. (Records of one sweep may name
    different commits: the repository moves while it runs.)"""
    last = load_record(path, commit)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    sweep: dict[int, dict] = {}
    for record in reversed(records):
        if not record.get("results") or record.get("label") != last.get("label"):
            continue
        if commit is not None and not str(record.get("commit", "")).startswith(commit):
            continue
        layers = record["args"]["layers"]
        if layers in sweep:
            break
        sweep[layers] = record
    return [sweep[n] for n in sorted(sweep)]


def plot_moda_layers(records: list[dict], out: Path) -> Path:
    """Train-step and peak-memory ratio vs Llama over the depth L, one line per MoDA implementation."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), layout="constrained")
    names = sorted({r["model"] for rec in records for r in rec["results"] if r["model"].startswith("moda")})
    for name in names:
        points = [(rec["args"]["layers"], row) for rec in records for row in rec["results"] if row["model"] == name]
        layers = [n for n, _ in points]
        for ax, metric in zip(axes, ("train", "peak")):
            stats = [_paired(row, metric) for _, row in points]
            ys = [m for m, _, _ in stats]
            err = [[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]]
            ax.errorbar(layers, ys, yerr=err, marker="o", capsize=3, label=name)
    for ax, title in zip(axes, ("train step ÷ Llama", "peak memory ÷ Llama")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({rec["args"]["layers"] for rec in records}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("layers L")
        ax.set_title(title, fontsize=10)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    args = records[-1].get("args", {})
    cfg = f"hidden {args.get('hidden', '?')}, batch {args.get('batch', '?')} × seq {args.get('seq', '?')}"
    return _finish(fig, f"MoDA cost over depth ({cfg}; median of paired ratios, whiskers min-max)", records[-1], out)


PLOTTERS: dict[str, Callable[[dict, Path], Path]] = {
    "dwa": plot_dwa, "models": plot_models, "moda_attention": plot_moda_attention,
    "moda_stream": plot_moda_stream, "moda_layers": plot_moda_layers,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns 0 when every requested plot was written, 1 when any was skipped."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench-dir", type=Path, default=BENCH, help="folder with the *.jsonl records")
    parser.add_argument("--out", type=Path, default=BENCH, help="folder for the PNGs")
    parser.add_argument("--commit", default=None, help="use the latest record whose commit starts with this")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS), help="which plots")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    skipped = 0
    for kind in args.kinds:
        try:
            if kind == "moda_layers":
                record = load_sweep(args.bench_dir / f"{kind}.jsonl", args.commit)
            else:
                record = load_record(args.bench_dir / f"{kind}.jsonl", args.commit)
        except NoRecord as e:
            print(f"skipped {kind}.png: {e}", file=sys.stderr)
            skipped += 1
            continue
        path = PLOTTERS[kind](record, args.out / f"{kind}.png")
        last = record[-1] if isinstance(record, list) else record
        print(f"wrote {path} (commit {last.get('commit')}, {last.get('date')})")
    return 1 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
