#!/usr/bin/env python
"""Every causal-LM family against the same Llama: several seeds, several depths, one corpus (issue 12 §1).

Each (depth, seed) pair builds the Llama from the seed first; every family model of that pair is built from the
same seed and then given the Llama's weights (its own new weights keep the family's initialisation: DWA
identity, zero AttnRes pseudo-queries, MoDA's FFN-side K/V projections), so the models differ only in what the
family adds. All runs share the corpus split, the tokenizer (BPE trained on the training split), the schedule
(AdamW 0.9/0.95, cosine, warm-up, matrices-only weight decay) and the data order of their seed; training is the
recipe's ``train_one``. Each finished run is stored as ``<output_dir>/runs/<key>.json`` (spec, model_type, seed,
layers, dataset, the validation-loss curve with steps and training seconds, parameters, train tokens/s); a
rerun skips the stored runs, so an interrupted study resumes where it stopped. A folder whose runs used other
settings is refused. Outputs: ``results.md`` (per depth: mean ± std validation loss, the paired Δ to the
same-seed Llama with a 95 % t-interval and seeds won, at equal steps and at equal wall-clock, parameters, train
tokens/s), ``results.json``, ``val_loss_<L>L.png`` (seed bands) and ``delta_vs_depth.png``.

Model specs (``--models``, comma-separated; ``llama`` must be one):
    llama | denseformer[:KxP] | moda[:no-ffn-kv][+post-norm] | attnres[:full|:blockN]
    | <any registry family>:field=value+field=value
(``attnres:blockN``: N blocks, 2L/N sub-layers each; ``attnres:attnres_block_size=S``: blocks of S sub-layers; see
``depthfusion_hf.recipes.study.specs``.)

Default invocation (``configs/clm_narrow.json``: width 64, 2 query / 1 KV heads; llama, DenseFormer 1x1 and
4x5, MoDA, AttnRes with blocks of 8 sub-layers; seeds 0 1; 6 and 12 layers; King James Bible, 2,048-token BPE;
200 steps of batch 8 x 128 tokens, evaluation every 25 steps on 32 validation blocks; 20 runs):
    OMP_NUM_THREADS=1 python scripts/compare_families.py
estimated 25-40 min on the 2-core machine. Measured under load (other jobs running, load average 6-8 on the
2 cores; 20-step probe runs): training s/step at 6 layers 0.17-0.31 (all five models), at 12 layers
0.22-0.63, at 24 layers 0.69-1.23 (MoDA the slowest), with swings of up to 3x between identical runs from the
other jobs; plus about 7 % for the evaluations, 2-3 s per run to build and save, and 25 s to load the corpus
and train the tokenizer. So about 3.4 s per step for the ten runs of one seed -> 2 x 200 x 3.4 s = 23 min, and
up to 40 min when the load is heavier.

The issue's main study (``--study``): the Bible at 6, 12 and 24 layers and the plays at 12 layers, seeds 0 1 2,
the same five models, 200 steps each (60 runs), into ``<output_dir>/kjv`` and ``<output_dir>/plays``:
    OMP_NUM_THREADS=1 nice -n 10 python scripts/compare_families.py --study --output_dir outputs/family_study
estimated 1 h 50 min of the 2 cores from the same measurements (about 9.7 s per step for the 20 runs of one
seed, x 200 steps x 3 seeds, plus evaluation and set-up), up to about 2 h 30 min under heavier load; rerun the
same command after an interruption (finished runs are kept). On a shared machine add ``--clock cpu`` (or rerun
with ``--report_only --clock cpu``): the equal-time comparison then uses each process's CPU time, which the
other jobs disturb far less than the wall clock (with one torch thread, as here: with several, threads that
spin while waiting count too). All timings above are with ``OMP_NUM_THREADS=1``. The plays corpus is fetched
once by ``scripts/setup.sh`` (or on first use) with pip.

Paper-scale (a GPU; DenseFormer's and MoDA's effects are reported at 24-48 layers and far more tokens):
    python scripts/compare_families.py --config configs/clm_small.json --layers 12 24 48 --seeds 0 1 2 \\
        --max_steps 20000 --batch_size 64 --block_size 512 --vocab_size 8192 --eval_steps 1000 \\
        --max_eval_blocks 512 --dataset <a Hub corpus, e.g. wikitext --dataset_config wikitext-103-raw-v1>

Other corpora: ``--dataset plays`` (Shakespeare's plays, see ``depthfusion_hf.data.plays``), a Hub id, or
``--train_files a.txt b.jsonl`` (the last ``--held_out_fraction`` of the documents is the validation split).
``--report_only`` rewrites the report and plots from the stored runs without training.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from depthfusion_hf.recipes.clm import TrainSettings, load_arch
from depthfusion_hf.recipes.study.data import prepare_study_data
from depthfusion_hf.recipes.study.grids import run_compare_grid
from depthfusion_hf.recipes.study.specs import DEFAULT_MODELS, parse_model_list, spec_syntax
from depthfusion_hf.recipes.study.store import RunStore
from depthfusion_hf.recipes.study.tables import compare_summary, compare_tables

REPO = Path(__file__).resolve().parent.parent
# The main study: (dataset, depths) stages, each in its own sub-folder; seeds 0 1 2.
STUDY_STAGES = (("kjv", (6, 12, 24)), ("plays", (12,)))
STUDY_SEEDS = (0, 1, 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated model specs:\n" + spec_syntax())
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--layers", type=int, nargs="+", default=[6, 12], help="depths (num_hidden_layers)")
    p.add_argument("--study", action="store_true",
                   help="the issue's main study: kjv at 6 12 24 layers and plays at 12, seeds 0 1 2 "
                        "(overrides --dataset, --train_files, --layers, --seeds)")
    p.add_argument("--dataset", default="kjv", help="'kjv', 'plays' (built-in) or a Hub dataset id (online)")
    p.add_argument("--train_files", nargs="*", default=None, help="local .txt/.md/.json/.jsonl files instead")
    p.add_argument("--dataset_config", default=None, help="Hub dataset configuration name")
    p.add_argument("--text_column", default="text", help="text field of Hub datasets and JSON files")
    p.add_argument("--held_out_fraction", type=float, default=0.03, help="last fraction of documents: validation")
    p.add_argument("--config", default=str(REPO / "configs" / "clm_narrow.json"), help="Llama-style model JSON")
    p.add_argument("--vocab_size", type=int, default=2048)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--max_train_blocks", type=int, default=None)
    p.add_argument("--max_eval_blocks", type=int, default=32)
    p.add_argument("--max_steps", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--warmup_ratio", type=float, default=0.05)
    p.add_argument("--eval_steps", type=int, default=25)
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU)")
    p.add_argument("--output_dir", default="outputs/compare_families")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="the equal-time comparison's clock: wall-clock, or the process's CPU time (steadier when other "
                        "jobs share the machine); both are stored, so --report_only can switch")
    p.add_argument("--report_only", action="store_true", help="only rewrite results.md / plots from stored runs")
    p.add_argument("--no_plots", action="store_true")
    args = p.parse_args(argv)
    try:
        args.specs = parse_model_list(args.models, sorted({d for _, ds in STUDY_STAGES for d in ds}) if args.study
                                      else args.layers)
    except ValueError as error:
        p.error(str(error))
    for name in ("max_steps", "eval_steps", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if min(args.layers) < 1:
        p.error(f"--layers must be >= 1; got {args.layers}")
    return args


def study_settings(args: argparse.Namespace, dataset: str, files: list[str] | None, arch: dict,
                   dataset_config: str | None = None) -> dict:
    """What every run of one stage shares (stored with each run; a folder with other settings is refused)."""
    settings = asdict(train_settings(args))
    settings.pop("seed")
    return dict(dataset=dataset, dataset_config=dataset_config, text_column=args.text_column, files=files,
                held_out_fraction=args.held_out_fraction, vocab_size=args.vocab_size,
                block_size=args.block_size, max_train_blocks=args.max_train_blocks,
                max_eval_blocks=args.max_eval_blocks, arch=arch, train=settings)


def train_settings(args: argparse.Namespace) -> TrainSettings:
    """The schedule of every run (the seed is set per run)."""
    return TrainSettings(max_steps=args.max_steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                         weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio, eval_steps=args.eval_steps,
                         logging_steps=max(1, args.eval_steps), bf16=args.bf16)


def report(records: list[dict], out: Path, title: str, plots: bool, args: argparse.Namespace) -> str:
    """Write ``results.md``, ``results.json`` and the plots for ``records``; returns the markdown."""
    clock = "cpu_seconds" if args.clock == "cpu" else "seconds"
    table = compare_tables(records, title, clock)
    (out / "results.md").write_text(table, encoding="utf-8")
    summary = {depth: {spec: {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in row.items()}
                       for spec, row in rows.items()} for depth, rows in compare_summary(records, clock).items()}
    (out / "results.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    if plots:
        from depthfusion_hf.plotting_study import plot_delta_vs_depth, plot_loss_curves

        for depth in sorted({r["layers"] for r in records}):
            plot_loss_curves([r for r in records if r["layers"] == depth], out / f"val_loss_{depth}L.png",
                             f"{title}: {depth} layers")
        plot_delta_vs_depth(records, out / "delta_vs_depth.png", title)
    return table


def run_stage(args: argparse.Namespace, dataset: str, files: list[str] | None, layers: list[int], seeds: list[int],
              out: Path, dataset_config: str | None = None) -> str:
    """One corpus: train what is missing, then report every run of the requested grid."""
    arch = load_arch(args.config)
    label = "files: " + ", ".join(files) if files else dataset
    store = RunStore(out, study_settings(args, label, files, arch, dataset_config))
    stored = store.records()  # fails now, before any work, on runs made with other settings
    wanted = {(s.text, depth, seed) for s in args.specs for depth in layers for seed in seeds}
    if args.report_only:
        records = [r for r in stored if (r["spec"], r["layers"], r["seed"]) in wanted]
    else:
        data = prepare_study_data(dataset, files, args.held_out_fraction, args.vocab_size, args.block_size,
                                  args.max_train_blocks, args.max_eval_blocks, dataset_config=dataset_config,
                                  text_column=args.text_column)
        print(f"{label}: {data.info}", flush=True)
        records = run_compare_grid(args.specs, seeds, layers, arch, data, train_settings(args), store, label)
    if not records:
        raise SystemExit(f"{out}: no stored runs to report")
    table = report(records, out, f"{label}, {args.max_steps} steps", not args.no_plots, args)
    print("\n" + table, flush=True)
    return table


def main(argv: list[str] | None = None) -> dict[str, str]:
    """Run the study (or its ``--study`` stages); returns each stage's markdown report by output folder."""
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(args.output_dir)
    if args.study:
        stages = [(dataset, None, list(layers), list(STUDY_SEEDS), out / dataset, None)
                  for dataset, layers in STUDY_STAGES]
    else:
        stages = [(args.dataset, args.train_files, args.layers, args.seeds, out, args.dataset_config)]
    reports = {}
    for dataset, files, layers, seeds, folder, dataset_config in stages:
        folder.mkdir(parents=True, exist_ok=True)
        reports[str(folder)] = run_stage(args, dataset, files, layers, seeds, folder, dataset_config)
    return reports


if __name__ == "__main__":
    main(sys.argv[1:])
