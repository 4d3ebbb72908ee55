#!/usr/bin/env python
"""Upcycling that pays? Pre-train a Llama, then continue it as itself and upcycled into each family (issue 12 §2).

1. Pre-training: a Llama of ``--layers`` blocks trained with the causal-LM recipe for ``--pretrain_steps`` on the
   first half of the training blocks, saved to ``<output_dir>/pretrain/final`` (skipped when that run is stored);
   or ``--init_from`` any Llama checkpoint holding its tokenizer: a folder, a Hub id, or with ``--gguf_file`` a
   GGUF file in that folder / Hub repository (dequantised once into a cached float folder).
2. Continuation, for each seed of ``--seeds``: the same number of steps (``--max_steps``, default: the
   pre-training steps) on the second half of the training blocks, (a) as the Llama, (b)-(c) upcycled with the
   registry's ``from_llama`` (``convert.llama_to_denseformer`` / ``llama_to_moda`` / ``llama_to_attnres``) to
   each spec of ``--models``. The new parameters (DWA weights, MoDA's FFN-side K/V projections, AttnRes
   pseudo-queries and key norms) train at ``--new_param_lr_scale`` × the learning rate, each scale of the list
   in its own run; the pretrained ones at the learning rate. Every run evaluates at step 0 (the upcycled model
   before any update: the DenseFormer's loss equals the Llama's) and every ``--eval_steps``.

The held-out documents are cut into a validation half and a test half: curves, the paired Δ to the continued
Llama and the choice of the lr scale (lowest mean validation loss per model) use validation only; the test
loss of every run is reported next to it, never used to choose. Every finished run is stored as JSON under
``<output_dir>/runs/`` (the same store as ``compare_families.py``), so a rerun resumes. Outputs:
``results.md`` (table per model and scale, chosen scale marked; mean validation curve), ``results.json``,
``continued_val_loss.png`` (chosen scales, seed bands).

Default (``configs/clm_narrow.json`` at 12 layers, King James Bible, 200 pre-training steps, then 200 steps for
llama, DenseFormer 1x1 and 4x5, MoDA and AttnRes with blocks of 8 sub-layers at new-parameter lr scales 1 and 10,
seeds 0 1 2: 1 + 3 x (1 + 4 x 2) = 28 runs of 200 steps):
    OMP_NUM_THREADS=1 nice -n 10 python scripts/upcycle.py --output_dir outputs/upcycle
estimated 45-60 min on the 2-core machine: 29 runs x 200 steps at 0.22-0.63 s/step (12 layers, width 64, batch
8 x 128; measured while other jobs loaded the 2 cores, mean about 0.45), plus about 7 % for the evaluations;
``--new_param_lr_scale 10`` alone (the scale to try first) roughly halves it. The seeds vary the continuation's
data order; the pre-trained Llama is one (``--pretrain_seed``).

From a local Llama (its tokenizer in the same folder), or a GGUF file:
    python scripts/upcycle.py --init_from path/to/llama --max_steps 1000 --dataset plays
    python scripts/upcycle.py --init_from FOLDER --gguf_file model.Q4_1.gguf --models denseformer:1x1,mhc
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from transformers import AutoTokenizer, set_seed

from depthfusion_hf.gguf_source import gguf_float_folder
from depthfusion_hf.recipes.clm import BASELINE, TrainSettings, build_model, load_arch, train_one
from depthfusion_hf.recipes.study.data import prepare_study_data
from depthfusion_hf.recipes.study.grids import run_continuations
from depthfusion_hf.recipes.study.specs import DEFAULT_MODELS, parse_model_list, spec_syntax
from depthfusion_hf.recipes.study.store import RunStore
from depthfusion_hf.recipes.study.tables import best_scales, continuation_summary, continuation_tables
from depthfusion_hf.safe_folder import check_target

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated model specs:\n" + spec_syntax())
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="continuation seeds (data order)")
    p.add_argument("--new_param_lr_scale", type=float, nargs="+", default=[1.0, 10.0],
                   help="learning-rate multipliers for the new parameters (each one a run; chosen on validation)")
    p.add_argument("--init_from", default=None,
                   help="a Llama checkpoint (folder or Hub id, with its tokenizer) to continue")
    p.add_argument("--gguf_file", default=None, help="with --init_from: a GGUF file in that folder / Hub repository")
    p.add_argument("--layers", type=int, default=12, help="depth of the pre-trained Llama")
    p.add_argument("--pretrain_steps", type=int, default=200)
    p.add_argument("--pretrain_seed", type=int, default=0)
    p.add_argument("--dataset", default="kjv", help="'kjv', 'plays' (built-in) or a Hub dataset id (online)")
    p.add_argument("--train_files", nargs="*", default=None, help="local .txt/.md/.json/.jsonl files instead")
    p.add_argument("--dataset_config", default=None, help="Hub dataset configuration name")
    p.add_argument("--text_column", default="text", help="text field of Hub datasets and JSON files")
    p.add_argument("--held_out_fraction", type=float, default=0.06,
                   help="last fraction of documents, cut into validation (first half) and test (second half)")
    p.add_argument("--config", default=str(REPO / "configs" / "clm_narrow.json"), help="Llama-style model JSON")
    p.add_argument("--vocab_size", type=int, default=2048)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--max_train_blocks", type=int, default=None)
    p.add_argument("--max_eval_blocks", type=int, default=32)
    p.add_argument("--max_steps", type=int, default=None, help="continuation steps (default: --pretrain_steps)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--warmup_ratio", type=float, default=0.05)
    p.add_argument("--eval_steps", type=int, default=25)
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU)")
    p.add_argument("--output_dir", default="outputs/upcycle")
    p.add_argument("--no_plots", action="store_true")
    args = p.parse_args(argv)
    try:
        args.specs = parse_model_list(args.models, [] if args.init_from else [args.layers])
    except ValueError as error:
        p.error(str(error))
    if args.gguf_file is not None and args.init_from is None:
        p.error("--gguf_file names a file in the --init_from folder / Hub repository: give --init_from with it")
    args.max_steps = args.max_steps if args.max_steps is not None else args.pretrain_steps
    for name in ("max_steps", "pretrain_steps", "eval_steps", "batch_size", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if any(s <= 0 for s in args.new_param_lr_scale):
        p.error(f"--new_param_lr_scale must be > 0; got {args.new_param_lr_scale}")
    return args


def halves(dataset):
    """The training blocks cut in two: pre-training gets the first half, the continuation the second."""
    middle = len(dataset) // 2
    if middle == 0:
        raise ValueError(f"need at least 2 training blocks to split pre-training and continuation; got {len(dataset)}")
    return dataset.select(range(middle)), dataset.select(range(middle, len(dataset)))


def settings_for(args: argparse.Namespace, steps: int, seed: int) -> TrainSettings:
    """The schedule of a run."""
    return TrainSettings(max_steps=steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                         weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio, eval_steps=args.eval_steps,
                         logging_steps=max(1, args.eval_steps), seed=seed, bf16=args.bf16)


def pretrain(args: argparse.Namespace, data, out: Path, arch: dict) -> Path:
    """Pre-train the Llama on the first half of the training blocks (skipped when ``pretrain/pretrain.json`` says
    this exact run finished); returns its ``final`` folder."""
    folder = out / "pretrain"
    final = folder / "final"
    record_path = folder / "pretrain.json"
    wanted = dict(arch=arch, layers=args.layers, seed=args.pretrain_seed,
                  settings=asdict(settings_for(args, args.pretrain_steps, args.pretrain_seed)))
    wanted = json.loads(json.dumps(wanted))
    if record_path.exists() and final.is_dir():
        stored = json.loads(record_path.read_text(encoding="utf-8"))
        if stored.get("run") == wanted:
            print(f"pre-trained Llama: {final} (stored, skipped)", flush=True)
            return final
        raise SystemExit(f"{record_path} records another pre-training run; use another --output_dir")
    check_target(final)
    set_seed(args.pretrain_seed)
    llama = build_model(BASELINE, dict(arch, num_hidden_layers=args.layers), data.tokenizer)
    first, _ = halves(data.train)
    result = train_one("llama (pre-training)", llama, first, data.validation, folder,
                       settings_for(args, args.pretrain_steps, args.pretrain_seed), data.tokenizer)
    record_path.write_text(json.dumps(dict(run=wanted, eval_loss=result.eval_loss, parameters=result.parameters,
                                           train_seconds=result.train_seconds), indent=1), encoding="utf-8")
    print(f"pre-trained Llama: val loss {result.eval_loss:.4f} -> {final}", flush=True)
    return final


def main(argv: list[str] | None = None) -> str:
    """Pre-train (or take ``--init_from``), continue every model, write the report; returns the markdown."""
    args = parse_args(argv)
    if args.gguf_file is not None:  # from here on the Llama is its cached float folder (its tokenizer included)
        args.init_from = str(gguf_float_folder(args.init_from, args.gguf_file))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch = load_arch(args.config)
    tokenizer = AutoTokenizer.from_pretrained(args.init_from) if args.init_from else None
    data = prepare_study_data(args.dataset, args.train_files, args.held_out_fraction, args.vocab_size,
                              args.block_size, args.max_train_blocks, args.max_eval_blocks, carve_test=True,
                              tokenizer=tokenizer, dataset_config=args.dataset_config, text_column=args.text_column)
    print(f"data: {data.info}", flush=True)
    llama_path = args.init_from if args.init_from else pretrain(args, data, out, arch)
    _, second = halves(data.train)
    label = "files: " + ", ".join(args.train_files) if args.train_files else args.dataset
    store_settings = dict(
        dataset=label, dataset_config=args.dataset_config, text_column=args.text_column,
        held_out_fraction=args.held_out_fraction, vocab_size=args.vocab_size,
        block_size=args.block_size, max_train_blocks=args.max_train_blocks, max_eval_blocks=args.max_eval_blocks,
        llama=str(llama_path) if args.init_from else dict(arch=arch, layers=args.layers,
                                                          steps=args.pretrain_steps, seed=args.pretrain_seed),
        train={k: v for k, v in asdict(settings_for(args, args.max_steps, 0)).items() if k != "seed"},
    )
    store = RunStore(out, store_settings)
    store.records()  # fails now on runs made with other settings
    records = run_continuations(args.specs, args.seeds, args.new_param_lr_scale, llama_path,
                                replace(data, train=second), settings_for(args, args.max_steps, 0), store)
    title = f"Upcycling: {label}, {args.max_steps} continued steps"
    table = continuation_tables(records, title)
    (out / "results.md").write_text(table, encoding="utf-8")
    summary = {f"{spec} @ {scale:g}": {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v)
                                       for k, v in row.items()}
               for (spec, scale), row in continuation_summary(records).items()}
    summary["chosen_lr_scale"] = best_scales(records)
    (out / "results.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    if not args.no_plots:
        from depthfusion_hf.plotting_study import plot_loss_curves

        chosen = summary["chosen_lr_scale"]
        shown = [r for r in records if r["lr_scale"] == (1.0 if r["spec"] == BASELINE else chosen[r["spec"]])]
        plot_loss_curves(shown, out / "continued_val_loss.png", f"{title} (validation, chosen lr scales)",
                         include_start=True)
    print("\n" + table, flush=True)
    return table


if __name__ == "__main__":
    main(sys.argv[1:])
