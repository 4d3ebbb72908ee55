"""The fair few-shot NER study (issue 12 §3): per-method settings chosen on a development split, then test.

For every training size and method, the study **selects** a learning rate and a step count on a dev split carved from
the training pool (never on the test split; :func:`select_point`), then **tests** the selected point on the training
sets of other seeds, scoring the fixed test split. The pool is that of :func:`depthfusion_hf.recipes.ner.load_splits`
without the copies of test sentences and without the dev sentences, so no training, dev or test sentence is shared.

Every finished run is one JSON file under ``<output_dir>/runs/`` (the studies' :class:`~.study.store.RunStore`, keyed by
phase, size, method and run); a rerun skips the runs it finds (resume) and refuses an output folder whose runs used
other fixed settings, or one holding report files but no run. After each run the report is rewritten
(:func:`write_report`): ``selected.json``, ``results.json`` / ``results.md`` (mean ± std test F1, the paired gains
over ``last`` and ``last_ln`` with a 95 % t-interval and the seeds won, wall time) and ``f1_vs_size.png``.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..data import TrainingSize, build_label_list, count_entities, parse_size
from ..models.configuration_dwatt import FUSION_METHODS
from ..plotting import plot_f1_vs_size
from .ner import (
    NerSettings,
    default_encoder,
    drop_test_copies,
    encode,
    encoder_name,
    f1_row,
    load_encoder,
    load_splits,
    run_one,
    sample_training_set,
)
from .records import table_lines
from .study.stats import paired_summary
from .study.store import RunStore, write_json_atomic, write_text_atomic

Sentence = dict[str, list[str]]

# NerSettings fields the study sets itself (per cell and run) or does not use.
_STUDY_CONTROLLED = {"config", "fusions", "sizes", "seeds", "learning_rate", "head_learning_rate", "max_steps",
                     "epochs", "output_dir", "validation_file", "selected_settings", "drop_test_duplicates"}
# Study fields that may change between invocations sharing one output folder (they select what runs, not how).
_FREE_FIELDS = {"methods", "sizes", "seeds", "shard", "output_dir", "config"}
BASELINES = ("last", "last_ln")
# What a study writes into its output folder.
OUTPUT_NAMES = ("runs", "selected.json", "results.json", "results.md", "f1_vs_size.png")


@dataclass
class NerStudySettings:
    """The study's grid, selection and data carving; ``base`` holds the recipe's data and optimiser settings.

    ``methods`` x ``sizes`` are the cells; ``seeds`` the test runs per cell; ``selection_seeds`` x
    ``learning_rates`` x ``step_grid`` the selection runs per cell (head learning rate =
    ``head_lr_ratio`` x the encoder's). ``dev_size`` sentences drawn from the pool with ``dev_seed`` are
    the dev split; ``drop_test_duplicates`` removes pool sentences whose tokens equal a test sentence.
    ``shard`` ``"k/n"``: run only the cells with index ``k`` mod ``n``.

    Raises:
        ValueError: an unknown method, a malformed size or shard, an empty grid, or a non-positive value.
    """

    methods: list[str] = field(default_factory=lambda: ["last", "last_ln", "concat", "deeper", "dwatt"])
    sizes: list = field(default_factory=lambda: ["5-shot", "10-shot", "50", "200"])
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    selection_seeds: list[int] = field(default_factory=lambda: [101, 102])
    learning_rates: list[float] = field(default_factory=lambda: [1e-4, 3e-4, 1e-3])
    head_lr_ratio: float = 10.0
    step_grid: list[int] = field(default_factory=lambda: [40, 120])
    dev_size: int = 200
    dev_seed: int = 0
    drop_test_duplicates: bool = True
    shard: str = "0/1"
    output_dir: str = "runs/ner_study"
    config: str | None = None
    base: NerSettings = field(default_factory=NerSettings)

    def __post_init__(self) -> None:
        self.sizes = [size if isinstance(size, TrainingSize) else parse_size(size) for size in self.sizes]
        unknown = [m for m in self.methods if m not in FUSION_METHODS]
        if unknown:
            raise ValueError(f"methods must be among {FUSION_METHODS}; got {unknown}")
        for name in ("methods", "sizes", "seeds", "selection_seeds", "learning_rates", "step_grid"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name} must not be empty")
            if len(set(map(str, values))) != len(values):
                raise ValueError(f"{name} has a value twice: {values}")
        if any(lr <= 0 for lr in self.learning_rates) or self.head_lr_ratio <= 0:
            raise ValueError(f"learning_rates and head_lr_ratio must be > 0; got {self.learning_rates}, "
                             f"{self.head_lr_ratio}")
        if any(not isinstance(s, int) or s < 1 for s in self.step_grid):
            raise ValueError(f"step_grid must hold integers >= 1; got {self.step_grid}")
        if self.dev_size < 1:
            raise ValueError(f"dev_size must be >= 1; got {self.dev_size}")
        self.shard_index, self.shard_count = parse_shard(self.shard)

    @classmethod
    def from_values(cls, values: dict) -> NerStudySettings:
        """Settings from one flat dict: study fields, plus recipe (``NerSettings``) fields for ``base``.

        Raises:
            ValueError: naming keys that are neither, or recipe keys the study sets itself.
        """
        own = {f.name for f in dataclasses.fields(cls)} - {"base"}
        recipe = {f.name for f in dataclasses.fields(NerSettings)} - _STUDY_CONTROLLED
        controlled = sorted(set(values) & _STUDY_CONTROLLED - own)
        if controlled:
            raise ValueError(f"the study sets {controlled} itself (per cell, from the selection grid)")
        unknown = sorted(key for key in set(values) - own - recipe if not key.startswith("_"))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}")
        base = NerSettings(**{k: v for k, v in values.items() if k in recipe})
        return cls(**{k: v for k, v in values.items() if k in own}, base=base)

    def fixed_record(self) -> dict:
        """The settings that make runs comparable (everything but what selects the cells): JSON values."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in _FREE_FIELDS | {"base"}}
        base = {key: value for key, value in self.base.record().items()
                if key not in _STUDY_CONTROLLED | {"num_threads"}}
        return values | {"base": base}

    def record(self) -> dict:
        """All settings as JSON values (sizes as labels)."""
        return self.fixed_record() | {"methods": self.methods, "sizes": [s.label for s in self.sizes],
                                      "seeds": self.seeds, "shard": self.shard, "config": self.config}


def parse_shard(spec: str) -> tuple[int, int]:
    """``"k/n"`` -> (k, n) with 0 <= k < n; ValueError otherwise."""
    try:
        index, count = (int(part) for part in str(spec).split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise ValueError(f"shard must be 'k/n' with 0 <= k < n; got {spec!r}")
    return index, count


@dataclass
class StudyData:
    """The sentences of one study: ``pool`` (training sets are drawn from it), ``dev``, ``test``.

    ``dropped`` counts the pool sentences removed as duplicates of a test sentence.
    """

    pool: list[Sentence]
    dev: list[Sentence]
    test: list[Sentence]
    label_list: list[str]
    entity_types: list[str]
    name: str
    dropped: int


def prepare_data(settings: NerStudySettings) -> StudyData:
    """Load the splits, drop test duplicates from the pool, carve the dev split; deterministic.

    Raises:
        ValueError: when ``dev_size`` leaves no pool to draw training sets from.
    """
    splits, name = load_splits(dataclasses.replace(settings.base, drop_test_duplicates=False))
    pool, test = splits["train"], splits["test"]
    dropped = 0
    if settings.drop_test_duplicates:
        pool, dropped = drop_test_copies(pool, test)
    if settings.dev_size >= len(pool):
        raise ValueError(f"dev_size={settings.dev_size} leaves no training pool (pool: {len(pool)} sentences)")
    chosen = set(random.Random(settings.dev_seed).sample(range(len(pool)), settings.dev_size))
    dev = sorted((pool[i] for i in sorted(chosen)), key=lambda s: len(s["tokens"]))  # cheaper padded batches
    rest = [s for i, s in enumerate(pool) if i not in chosen]
    label_list = build_label_list(splits["train"], splits["validation"], test)
    return StudyData(rest, dev, test, label_list, sorted(count_entities(splits["train"])), name, dropped)


def select_point(selection_runs: list[dict]) -> dict:
    """The grid point with the best mean dev F1 over its runs; ties: fewer steps, then the lower rate.

    ``selection_runs`` are the selection records of one cell (keys ``learning_rate``,
    ``head_learning_rate``, ``max_steps``, ``dev_f1``). Returns the point with ``dev_f1_mean`` and
    ``dev_f1_std`` over its runs and ``runs`` (how many).
    """
    points: dict[tuple, list[float]] = {}
    for run in selection_runs:
        points.setdefault((run["max_steps"], run["learning_rate"], run["head_learning_rate"]), []).append(
            run["dev_f1"])
    best = min(points, key=lambda p: (-statistics.mean(points[p]), p[0], p[1]))
    f1 = points[best]
    return {"max_steps": best[0], "learning_rate": best[1], "head_learning_rate": best[2],
            "dev_f1_mean": statistics.mean(f1), "dev_f1_std": statistics.stdev(f1) if len(f1) > 1 else 0.0,
            "runs": len(f1)}


def paired_gain(values: dict[int, float], baseline: dict[int, float]) -> dict | None:
    """Paired difference ``values - baseline`` over the seeds both have: mean, std, 95 % t-interval, seeds won.

    Returns ``None`` when no seed is shared; the interval is ``None`` for a single seed. ``wins`` counts
    seeds where the difference is > 0 (a tie is not a win).
    """
    seeds = sorted(set(values) & set(baseline))
    if not seeds:
        return None
    diffs = [values[s] - baseline[s] for s in seeds]
    summary = paired_summary(diffs, higher_is_better=True)
    spread = {"std": summary.std, "low": summary.low, "high": summary.high} if summary.n > 1 else \
        {"std": None, "low": None, "high": None}
    return {"n": summary.n, "mean": summary.mean, **spread, "wins": summary.won, "diffs": diffs}


def run_key(phase: str, size: str, method: str, name: str) -> str:
    """The store key of the run ``name`` of ``phase`` (``"select"`` or ``"test"``) in one (size, method) cell."""
    return RunStore.key(phase=phase, size=size, method=method, run=name)


def study_store(settings: NerStudySettings) -> RunStore:
    """The run store of ``settings.output_dir``, checked: every stored run used these fixed settings, and a folder
    without runs holds none of the report files (they were not written by a study and would be replaced).

    Raises:
        ValueError: naming the settings that differ from a stored run's (:class:`~.study.store.SettingsMismatch`),
            or the files in the way.
    """
    out = Path(settings.output_dir)
    store = RunStore(out, settings.fixed_record())
    in_the_way = [name for name in OUTPUT_NAMES if (out / name).exists()]
    if in_the_way and not store.records():
        raise ValueError(f"{out} holds {in_the_way} but no run of a study (the report would replace them); use "
                         "another output_dir")
    return store


def selection_name(seed: int, learning_rate: float, steps: int) -> str:
    """File stem of one selection run."""
    return f"seed{seed}_lr{learning_rate:g}_steps{steps}"


def run_cell(settings: NerStudySettings, data: StudyData, size: TrainingSize, method: str, context: dict,
             store: RunStore, on_run) -> None:
    """Selection then test runs of one (size, method) cell, skipping the stored ones; ``on_run(phase)`` after each."""
    pool_index = {id(s): i for i, s in enumerate(data.pool)}

    def train_and_store(phase: str, name: str, seed: int, lr: float, steps: int, evaluation: dict) -> dict:
        key = run_key(phase, size.label, method, name)
        found = store.get(key)
        if found is not None:
            return found
        train = sample_training_set(data.pool, size, seed, data.entity_types)
        head_lr = float(f"{lr * settings.head_lr_ratio:.12g}")  # 3e-3, not 0.0029999999999999996
        run_settings = dataclasses.replace(settings.base, learning_rate=lr, head_learning_rate=head_lr,
                                           max_steps=steps)
        record = {"phase": phase, "size": size.label, "method": method, "learning_rate": lr,
                  "head_learning_rate": head_lr, "max_steps": steps}
        record.update(run_one(run_settings, context["encoder"], context["tokenizer"], train, method, seed,
                              data.label_list, evaluation, context["workdir"]))
        record["train_indices"] = sorted(pool_index[id(s)] for s in train)
        store.put(key, record)
        score = record.get("dev_f1", record.get("f1"))
        print(f"{phase:>6} size={size.label:>7} {method:>7} seed={seed} lr={lr:g} steps={steps}: F1 {score:6.2f} "
              f"({record['train_seconds']:.0f}s train)", flush=True)
        on_run(phase)
        return record

    selection = [train_and_store("select", selection_name(seed, lr, steps), seed, lr, steps, context["dev"])
                 for lr in settings.learning_rates for steps in settings.step_grid
                 for seed in settings.selection_seeds]
    point = select_point(selection)
    for seed in settings.seeds:
        train_and_store("test", f"seed{seed}", seed, point["learning_rate"], point["max_steps"], context["test"])


def cells(settings: NerStudySettings) -> list[tuple[TrainingSize, str]]:
    """Every (size, method) cell in run order; a shard keeps every n-th one."""
    grid = [(size, method) for size in settings.sizes for method in settings.methods]
    return grid[settings.shard_index :: settings.shard_count]


def summarise_study(settings: NerStudySettings, records: list[dict]) -> dict:
    """The selected points, and per (size, method) the test F1 and paired gains, from stored ``records``.

    Only the stored runs of the current grid count (other seeds or grid points in the folder are ignored).
    """
    grid = {(selection_name(s, lr, st)) for s in settings.selection_seeds for lr in settings.learning_rates
            for st in settings.step_grid}
    selected, rows = {}, []
    for size in settings.sizes:
        for method in settings.methods:
            mine = [r for r in records if r["size"] == size.label and r["method"] == method]
            chosen = [r for r in mine if r["phase"] == "select"
                      and selection_name(r["seed"], r["learning_rate"], r["max_steps"]) in grid]
            if len(chosen) == len(grid):
                selected.setdefault(size.label, {})[method] = select_point(chosen)
            tests = [r for r in mine if r["phase"] == "test" and r["seed"] in settings.seeds]
            if not tests:
                continue
            row = f1_row(size.label, method, tests) | {
                   "learning_rate": tests[0]["learning_rate"], "max_steps": tests[0]["max_steps"],
                   "train_seconds_mean": statistics.mean(r["train_seconds"] for r in tests),
                   "train_cpu_seconds_mean": statistics.mean(r["train_cpu_seconds"] for r in tests)
                   if all("train_cpu_seconds" in r for r in tests) else None,
                   "cell_seconds": sum(r["train_seconds"] + r["eval_seconds"] for r in chosen + tests)}
            scores = {r["seed"]: r["f1"] for r in tests}
            for baseline in BASELINES:
                base = {r["seed"]: r["f1"] for r in records if r["phase"] == "test" and r["size"] == size.label
                        and r["method"] == baseline and r["seed"] in settings.seeds}
                row[f"gain_over_{baseline}"] = paired_gain(scores, base) if method != baseline else None
            rows.append(row)
    return {"selected": selected, "summary": rows}


def _gain_cell(gain: dict | None) -> str:
    if gain is None:
        return "–"
    interval = "" if gain["low"] is None else f" [{gain['low']:+.2f}, {gain['high']:+.2f}]"
    return f"{gain['mean']:+.2f}{interval} ({gain['wins']}/{gain['n']})"


def _time_cell(row: dict) -> str:
    cpu = row["train_cpu_seconds_mean"]
    cpu_text = "" if cpu is None else f" ({cpu:.1f})"
    return f"{row['train_seconds_mean']:.1f}{cpu_text} / {row['cell_seconds']:.0f}"


def study_markdown(settings: NerStudySettings, summary: dict) -> str:
    """results.md: selected settings, test F1 table, paired gains over ``last`` and ``last_ln``, wall time."""
    rows = {(r["size"], r["fusion"]): r for r in summary["summary"]}

    def per_size(cell, methods=settings.methods) -> list[list[str]]:
        """One row per size: ``cell(summary row)`` for each method, "–" where the cell has no row."""
        return [[size.label, *(cell(rows[(size.label, m)]) if (size.label, m) in rows else "–" for m in methods)]
                for size in settings.sizes]

    header = ["size", *settings.methods]
    selected = []
    for size in settings.sizes:
        chosen = summary["selected"].get(size.label, {})
        selected.append([size.label, *(f"{chosen[m]['learning_rate']:g} / {chosen[m]['max_steps']} "
                                       f"({chosen[m]['dev_f1_mean']:.1f})" if m in chosen else "–"
                                       for m in settings.methods)])
    f1 = per_size(lambda r: f"{r['f1_mean']:.2f} ± {r['f1_std']:.2f} ({r['runs']})")
    sentences = {r["size"]: r["train_sentences"] for r in reversed(summary["summary"])}  # each size's first row
    f1 = [[size, f"{sentences[size]:.1f}", *cells] for size, *cells in f1 if size in sentences]
    lines = ["Settings selected on the dev split (encoder lr / steps; mean dev F1 over the selection seeds):", "",
             *table_lines(header, selected), "", "Test entity F1, mean ± std over the test seeds (runs):", "",
             *table_lines(["size", "train sentences (mean)", *settings.methods], f1)]
    for baseline in BASELINES:
        others = [m for m in settings.methods if m != baseline]
        if baseline in settings.methods and others:
            gains = per_size(lambda r: _gain_cell(r[f"gain_over_{baseline}"]), others)  # noqa: B023 - used at once
            lines += ["", f"Paired gain in test F1 over `{baseline}` (same seed, same training set): mean "
                          "[95 % t-interval] (seeds won / seeds):", "", *table_lines(["size", *others], gains)]
    lines += ["", "Time: mean training seconds per test run, wall (CPU) / all wall seconds of the cell (selection + "
                  "test, training + scoring); wall well above CPU means the machine was busy:", "",
              *table_lines(header, per_size(_time_cell))]
    return "\n".join(lines) + "\n"


def describe(settings: NerStudySettings, data: StudyData) -> dict:
    """The data and encoder of a study, for the report: names and split sizes."""
    encoder = settings.base.model_name_or_path or default_encoder()
    return {"name": data.name, "encoder": encoder_name(encoder), "pool": len(data.pool), "dev": len(data.dev),
            "test": len(data.test), "dropped_test_duplicates": data.dropped}


def write_report(settings: NerStudySettings, data_description: dict, plot: bool = True) -> dict:
    """Rewrite selected.json, results.json, results.md (and with ``plot`` f1_vs_size.png) from the stored runs."""
    out = Path(settings.output_dir)
    summary = summarise_study(settings, study_store(settings).records())
    write_json_atomic(out / "selected.json", summary["selected"])
    write_json_atomic(out / "results.json", {"data": data_description, "settings": settings.record(), **summary})
    header = (f"Few-shot NER study; data: {data_description['name']}; encoder: {data_description['encoder']}; "
              f"test seeds {settings.seeds}, selection seeds {settings.selection_seeds}, grid lr "
              f"{settings.learning_rates} (head x{settings.head_lr_ratio:g}) x steps {settings.step_grid}; dev "
              f"{settings.dev_size} sentences carved from the pool.\n\n")
    write_text_atomic(out / "results.md", header + study_markdown(settings, summary))
    if plot and summary["summary"]:
        plot_f1_vs_size(summary["summary"], settings.methods, out / "f1_vs_size.png",
                        f"{data_description['name']}\nencoder: {data_description['encoder']}; per-method settings "
                        f"selected on dev")
    return summary


def run_study(settings: NerStudySettings) -> dict:
    """Run (or resume) this shard's cells, rewriting the report after every run; return the final summary."""
    store = study_store(settings)  # refuses a folder of other settings before any work
    data = prepare_data(settings)
    encoder, tokenizer = load_encoder(settings.base)
    label2id = {label: i for i, label in enumerate(data.label_list)}
    description = describe(settings, data)
    print(f"data: {data.name}: pool {len(data.pool)} (dropped {data.dropped} test duplicates), dev {len(data.dev)}, "
          f"test {len(data.test)} sentences; encoder {encoder}", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ner_study_") as workdir:
        context = {"encoder": encoder, "tokenizer": tokenizer, "workdir": workdir,
                   "dev": {"dev": (data.dev, encode(data.dev, tokenizer, label2id, settings.base.max_length))},
                   "test": {"test": (data.test, encode(data.test, tokenizer, label2id, settings.base.max_length))}}
        for size, method in cells(settings):
            run_cell(settings, data, size, method, context, store,
                     lambda phase: write_report(settings, description, plot=phase == "test"))
    summary = write_report(settings, description)
    print(f"study: {time.perf_counter() - start:.0f}s in this invocation", flush=True)
    return summary


__all__ = ["NerStudySettings", "StudyData", "cells", "describe", "paired_gain", "parse_shard", "prepare_data",
           "run_key", "run_study", "select_point", "study_markdown", "study_store", "summarise_study", "write_report"]
