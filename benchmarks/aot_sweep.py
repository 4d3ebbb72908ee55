"""The full ahead-of-time compile sweep: every case of ``tests/kernels/aot.py``, every kernel specialisation, sm_80
and sm_90, no GPU needed.

    python benchmarks/aot_sweep.py [--cases all|ci|NAMES] [--jobs 2] [--label L] [--out docs/bench/aot_sweep.jsonl]

Drives the public ops and model forwards / backwards / decoding on CPU tensors the launch code takes for CUDA
tensors, records each launch's specialisation, compiles each distinct one once per target in a fresh process
and Triton cache (``tests/kernels/aot.py``), and prints

- the table: kernel, dtypes, tiles (the constexprs and launch options), target, registers, spills, shared
  memory (bytes, and % of the target's per-block limit), grid of the largest launch, the cases that launch it,
  and what is wrong with it (no compile, shared memory past the limit, spills in a bf16 / fp16 configuration,
  a grid past CUDA's limits);
- a summary per kernel and target (compiled / failed / with problems) and the cases that could not be driven.

One record per run is appended to ``--out`` (the header of ``benchmarks/harness.py``, Triton's version and one row
per (specialisation, target)). ``--python`` runs the harness under another interpreter (e.g. a venv holding
another Triton: ``--python /tmp/venv36/bin/python``); its Triton version is the one recorded.
Timings are compile seconds of one process each, on a loaded machine: context, never a threshold.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
from harness import BENCH_DIR, append_record, record_header  # noqa: E402

from tests.kernels import aot  # noqa: E402

TILE_KEYS = ("BLOCK", "G_PAD", "DEPTH_DOT", "INPUT_PRECISION", "UPCAST", "HAS_", "DELTA_FROM_H", "ACCUMULATE")


def _dtypes(launch: aot.Launch) -> str:
    """The tensor dtypes of a launch in order of first use, e.g. ``bf16`` or ``fp32+bf16`` (int64 tables left out)."""
    seen = []
    for kind in launch.signature.values():
        if kind.startswith("*") and kind != "*i64" and kind[1:] not in seen:
            seen.append(kind[1:])
    return "+".join(seen)


def _tiles(launch: aot.Launch) -> str:
    names = list(launch.signature)
    consts = [(names[p[0]], v) for p, v in launch.constexprs if len(p) == 1 and launch.signature[names[p[0]]]
              == "constexpr"]
    parts = [f"{n}={v}" for n, v in consts if n.startswith(TILE_KEYS)]
    parts += [f"{k}={v}" for k, v in sorted(launch.options.items())]
    return " ".join(parts)


def rows_of(run: aot.Run) -> list[dict]:
    """One row per (specialisation, target), with the cases that launch it and its problems."""
    by_spec: dict[str, list[aot.Launch]] = collections.defaultdict(list)
    for launch in run.launches:
        by_spec[launch.spec_key()].append(launch)
    rows = []
    for (key, capability), result in sorted(run.results.items(), key=lambda item: (
            by_spec[item[0][0]][0].kernel, _dtypes(by_spec[item[0][0]][0]), item[0][1], item[0][0])):
        launches = by_spec[key]
        first = launches[0]
        biggest = max(launches, key=lambda launch: tuple(launch.grid))
        limit = aot.TARGETS[capability]
        problems = aot.problems(biggest, result)
        rows.append(dict(
            spec=key, kernel=first.kernel.split(":")[-1], module=first.kernel.split(":")[0], dtypes=_dtypes(first),
            tiles=_tiles(first), specialisation=first.describe(), target=f"sm_{capability}", ok=result["ok"],
            registers=result.get("registers"), spill_stores=result.get("spill_stores"),
            spill_loads=result.get("spill_loads"), stack=result.get("stack"), shared=result.get("shared"),
            shared_limit=limit, grid=biggest.grid, cases=sorted({launch.case for launch in launches}),
            problems=problems, error=result.get("error"), compile_s=result["seconds"], triton=result["triton"]))
    return rows


def print_table(rows: list[dict]) -> None:
    print("| kernel | dtypes | tiles | target | registers | spills (B st/ld) | shared (B, % of limit) | grid | "
          "cases | problems |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row["ok"]:
            spills = f"{row['spill_stores']}/{row['spill_loads']}"
            shared = f"{row['shared']} ({100 * row['shared'] / row['shared_limit']:.0f} %)"
            regs = row["registers"]
        else:
            spills = shared = regs = "-"
        cases = row["cases"][0] + (f" (+{len(row['cases']) - 1})" if len(row["cases"]) > 1 else "")
        problem = "; ".join(p.split("\n")[0][:160] for p in row["problems"]) or "ok"
        print(f"| {row['kernel']} | {row['dtypes']} | {row['tiles']} | {row['target']} | {regs} | {spills} | "
              f"{shared} | {row['grid']} | {cases} | {problem} |")


def summary(rows: list[dict], run: aot.Run) -> dict:
    """Per kernel and target: specialisations, how many compile, how many have a problem; undrivable cases."""
    table: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.Counter())
    for row in rows:
        counts = table[f"{row['kernel']} {row['target']}"]
        counts["specialisations"] += 1
        counts["compile"] += row["ok"]
        counts["fail to compile"] += not row["ok"]
        counts["with a problem"] += bool(row["problems"])
    return dict(per_kernel={k: dict(v) for k, v in sorted(table.items())},
                cases=len(run.case_errors), cases_not_driven={c: e for c, e in run.case_errors.items() if e},
                specialisations=len({row["spec"] for row in rows}), compiles=len(rows),
                compile_failures=sum(not row["ok"] for row in rows),
                with_problems=sum(bool(row["problems"]) for row in rows), timing=run.timing)


def _interpreter_versions(python: str) -> dict:
    code = "import json, torch, triton; print(json.dumps({'torch': torch.__version__, 'triton': triton.__version__}))"
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="all", help="'all', 'ci', or comma-separated case names / prefixes")
    parser.add_argument("--targets", default="80,90")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that records and compiles")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "aot_sweep.jsonl")
    parser.add_argument("--no-record", action="store_true", help="print only (no line appended to --out)")
    args = parser.parse_args(argv)
    versions = _interpreter_versions(args.python)
    with tempfile.TemporaryDirectory(prefix="aot-sweep-") as tmp:
        run = aot.run_harness(args.cases, Path(tmp) / "aot.jsonl", targets=args.targets, jobs=args.jobs,
                              timeout=6 * 3600, python=args.python)
    rows = rows_of(run)
    print(f"# AOT sweep: {len(run.case_errors)} cases, torch {versions['torch']}, triton {versions['triton']}, "
          f"targets {args.targets}")
    print_table(rows)
    result = summary(rows, run)
    print(json.dumps(result, indent=1))
    if not args.no_record:
        record = dict(record_header(torch.device("cpu"), argv, args.label), **versions, targets=args.targets,
                      summary=result, rows=rows)
        print(f"# record appended to {append_record(args.out, record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
