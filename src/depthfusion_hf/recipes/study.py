"""Multi-seed, multi-depth studies of the causal-LM families against the same Llama (issue 12).

The pieces ``scripts/compare_families.py`` and ``scripts/upcycle.py`` are made of:

- :func:`parse_model_spec`: ``llama``, ``denseformer:4x5``, ``moda:no-ffn-kv``, ``attnres:block8``, or for any
  registry family ``family:field=value+field=value`` (so a family added to the registry later works at once);
- :func:`prepare_study_data`: one corpus, one tokenizer, packed train / validation (/ test) blocks;
- :class:`RunStore`: one JSON file per finished run, written atomically when the run ends; a rerun skips the
  runs it finds, and refuses a folder whose runs used other settings;
- :func:`train_recorded`: one run of the recipe's ``train_one`` (no second training loop) with a wall-clock
  callback (evaluation excluded) and, optionally, a separate learning rate for the new (upcycled) parameters;
- :func:`run_compare_grid` / :func:`run_continuations`: the two studies' grids;
- :func:`paired_summary`, :func:`interpolate_curve`, :func:`compare_tables`, :func:`continuation_tables`:
  the statistics and the markdown report.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import math
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, TrainerCallback, set_seed

from ..families import FAMILIES, causal_lm_families
from .clm import (
    BASELINE,
    DepthFusionTrainer,
    TrainSettings,
    build_config,
    build_model,
    new_parameter_names,
    run_name,
    train_one,
)

# ---------------------------------------------------------------------------------------------------
# Model specs
# ---------------------------------------------------------------------------------------------------

# The models both studies compare by default: the Llama and one representative variant of every family.
DEFAULT_MODELS = "llama,denseformer:1x1,denseformer:4x5,moda,attnres:block8"


def _denseformer_spec(variant: str) -> dict[str, Any]:
    match = re.fullmatch(r"(\d+)x(\d+)", variant)
    if match is None:
        raise ValueError(f"denseformer variant must be KxP (dilation x period, e.g. 4x5); got {variant!r}")
    return {"dwa_dilation": int(match[1]), "dwa_period": int(match[2])}


def _moda_spec(variant: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for part in variant.split("+"):
        if part == "no-ffn-kv":
            fields["moda_ffn_kv"] = False
        elif part in ("pre-norm", "post-norm"):
            fields["norm_position"] = part.split("-")[0]
        else:
            raise ValueError(f"moda variant parts must be 'no-ffn-kv', 'pre-norm' or 'post-norm' joined by '+'; "
                             f"got {part!r}")
    return fields


def _attnres_spec(variant: str) -> dict[str, Any]:
    if variant == "full":
        return {"attnres_block_size": None}
    match = re.fullmatch(r"block(\d+)", variant)
    if match is None:
        raise ValueError(f"attnres variant must be 'full' or 'blockS' (S sub-layers per block, e.g. block8); "
                         f"got {variant!r}")
    return {"attnres_block_size": int(match[1])}


# Short variant syntaxes of the registry's families (model_type -> (syntax help, parser)). A family without an
# entry here still takes the generic ``family:field=value+field=value`` form.
SPEC_SHORTHANDS: dict[str, tuple[str, Callable[[str], dict[str, Any]]]] = {
    "denseformer": ("denseformer:KxP (dilation x period; default 1x1)", _denseformer_spec),
    "moda": ("moda[:no-ffn-kv][+post-norm] (default: FFN-side depth K/V, pre-norm)", _moda_spec),
    "attnres": ("attnres:full | attnres:blockS (S sub-layers per block; default full)", _attnres_spec),
}


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@dataclass(frozen=True)
class ModelSpec:
    """One model of a study.

    Attributes:
        text: the spec as written (``"denseformer:4x5"``); the run store's key and the tables' label.
        kind: ``"llama"`` or a causal-LM ``model_type`` of the family registry.
        fields: the family's config fields (``{"dwa_dilation": 4, "dwa_period": 5}``).
    """

    text: str
    kind: str
    fields: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def is_baseline(self) -> bool:
        """True for the plain Llama."""
        return self.kind == BASELINE


def spec_syntax() -> str:
    """One line per model kind: how to write its spec (for ``--help``)."""
    lines = [f"{BASELINE}"]
    for kind in causal_lm_families():
        short = SPEC_SHORTHANDS.get(kind)
        options = sorted(spec_field_names(kind)[1])
        extra = f"; upcycling only: {', '.join(options)}" if options else ""
        generic = f"{kind}:field=value+field=value (any {FAMILIES[kind].config_class.__name__} field{extra})"
        lines.append(f"{short[0]}; or {generic}" if short else generic)
    return "\n".join(lines)


def spec_field_names(kind: str) -> tuple[set[str], set[str]]:
    """The names a spec of ``kind`` may set: its config's fields, and the options only its registry ``from_llama``
    takes (e.g. MoDA's ``ffn_kv_init``; valid for upcycling only)."""
    family = FAMILIES[kind]
    config_fields = set(getattr(family.config_class, "__dataclass_fields__", {}))
    options = set()
    if family.from_llama is not None:
        parameters = list(inspect.signature(family.from_llama).parameters.values())[1:]  # after the model
        options = {q.name for q in parameters if q.kind is q.POSITIONAL_OR_KEYWORD or q.kind is q.KEYWORD_ONLY}
    return config_fields, options - config_fields


def parse_model_spec(text: str) -> ModelSpec:
    """Parse ``kind[:variant]`` (see :func:`spec_syntax`); the kind is read from the family registry.

    Raises:
        ValueError: an unknown kind (naming the known ones), a bad variant, or a field the family's config lacks.
    """
    text = text.strip()
    kind, _, variant = text.partition(":")
    kinds = causal_lm_families() + (BASELINE,)
    if kind not in kinds:
        raise ValueError(f"model spec {text!r}: kind must be one of {kinds}; got {kind!r}")
    if kind == BASELINE:
        if variant:
            raise ValueError(f"model spec {text!r}: the {BASELINE} baseline takes no variant")
        return ModelSpec(text, kind, {})
    if not variant:
        return ModelSpec(text, kind, {})
    if "=" in variant:
        fields = {}
        for part in variant.split("+"):
            name, sep, value = part.partition("=")
            if not sep or not name:
                raise ValueError(f"model spec {text!r}: expected field=value parts joined by '+'; got {part!r}")
            fields[name] = _json_value(value)
        config_fields, upcycling_options = spec_field_names(kind)
        unknown = sorted(set(fields) - config_fields - upcycling_options)
        if unknown:
            raise ValueError(f"model spec {text!r}: {FAMILIES[kind].config_class.__name__} has no field(s) {unknown} "
                             f"(upcycling options: {sorted(upcycling_options)})")
        return ModelSpec(text, kind, fields)
    if kind not in SPEC_SHORTHANDS:
        raise ValueError(f"model spec {text!r}: {kind} has no short variant syntax; write {kind}:field=value")
    return ModelSpec(text, kind, SPEC_SHORTHANDS[kind][1](variant))


def parse_model_list(text: str) -> list[ModelSpec]:
    """Parse a comma-separated list of specs; the Llama baseline must be in it (every comparison is paired with it).

    Raises:
        ValueError: a bad spec, a repeated spec, or no ``llama``.
    """
    specs = [parse_model_spec(part) for part in text.split(",") if part.strip()]
    texts = [s.text for s in specs]
    repeated = sorted({t for t in texts if texts.count(t) > 1})
    if repeated:
        raise ValueError(f"--models lists {repeated} more than once")
    if BASELINE not in texts:
        raise ValueError(f"--models must include {BASELINE!r} (the paired baseline); got {texts}")
    return specs


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------


@dataclass
class StudyData:
    """A study's corpus, cut once: the tokenizer and the packed blocks every run of the study shares.

    Attributes:
        tokenizer: the byte-level BPE trained on the training documents.
        train: ``datasets.Dataset`` of training blocks (``input_ids``, ``labels``: [block_size]).
        validation: blocks of the validation documents (model and hyperparameter choices are made on these).
        test: blocks of the test documents, or ``None`` when the study carves no test split.
        info: the description stored with every run (document and block counts).
    """

    tokenizer: Any
    train: Any
    validation: Any
    test: Any
    info: dict


def prepare_study_data(
    dataset: str = "kjv",
    files: Sequence[str] | None = None,
    held_out_fraction: float = 0.03,
    vocab_size: int = 2048,
    block_size: int = 128,
    max_train_blocks: int | None = None,
    max_eval_blocks: int | None = 64,
    carve_test: bool = False,
    tokenizer: Any = None,
    dataset_config: str | None = None,
    text_column: str = "text",
) -> StudyData:
    """Load a corpus (``load_documents``: ``kjv``, ``plays``, a Hub id, or local ``files``), hold out its last
    ``held_out_fraction`` of documents, train the tokenizer on the rest and pack blocks.

    With ``carve_test`` the held-out documents are split in two contiguous halves: validation (first) and test
    (second); choices are made on validation, the test split is only reported. A given ``tokenizer`` (e.g. a
    pretrained checkpoint's) is used instead of training one. ``dataset_config`` and ``text_column`` are passed to
    ``load_documents`` (Hub datasets; ``text_column`` also names the field of JSON files).
    """
    from ..data.corpus import load_documents, pack_into_blocks, split_documents, train_bpe_tokenizer

    documents = load_documents(dataset, list(files) if files else None, text_column, dataset_config)
    train_docs, held_out = split_documents(documents, held_out_fraction)
    if carve_test:
        if len(held_out) < 2:
            raise ValueError(f"carving validation and test needs >= 2 held-out documents; got {len(held_out)} "
                             "(raise held_out_fraction)")
        val_docs, test_docs = held_out[: len(held_out) // 2], held_out[len(held_out) // 2:]
    else:
        val_docs, test_docs = held_out, None
    tokenizer = tokenizer if tokenizer is not None else train_bpe_tokenizer(train_docs, vocab_size)
    train = pack_into_blocks(tokenizer, train_docs, block_size, max_train_blocks)
    validation = pack_into_blocks(tokenizer, val_docs, block_size, max_eval_blocks)
    test = pack_into_blocks(tokenizer, test_docs, block_size, max_eval_blocks) if test_docs else None
    info = dict(documents=len(documents), train_documents=len(train_docs), validation_documents=len(val_docs),
                test_documents=len(test_docs) if test_docs else 0, train_blocks=len(train),
                validation_blocks=len(validation), test_blocks=len(test) if test is not None else 0)
    return StudyData(tokenizer, train, validation, test, info)


# ---------------------------------------------------------------------------------------------------
# The run store
# ---------------------------------------------------------------------------------------------------


def _flatten(settings: dict, prefix: str = "") -> dict:
    """``{"train": {"max_steps": 6}}`` -> ``{"train.max_steps": 6}``."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class SettingsMismatch(ValueError):
    """A study folder holds runs made with other settings; mixing them would compare unlike runs."""


class RunStore:
    """Finished runs of a study, one JSON file each under ``<folder>/runs/``.

    A run file is written (to a temporary name, then renamed) only when its run has finished, so an
    interrupted study leaves only complete runs; a rerun skips every run whose key it finds. Every run
    stores the study's ``settings``; a store refuses to add to or read runs with other settings
    (:class:`SettingsMismatch`), so a changed command never mixes its runs with the old ones silently.
    """

    def __init__(self, folder: str | os.PathLike, settings: dict):
        self.folder = Path(folder)
        self.runs_dir = self.folder / "runs"
        self.settings = json.loads(json.dumps(settings, default=str))  # as it will read back

    @staticmethod
    def key(**parts: Any) -> str:
        """A file-name-safe key from the run's identifying parts (spec, layers, seed, ...)."""
        text = "-".join(f"{name}={parts[name]}" for name in sorted(parts))
        return re.sub(r"[^A-Za-z0-9=.+_-]", "_", text)

    def path(self, key: str) -> Path:
        """Where the run ``key`` is stored."""
        return self.runs_dir / f"{key}.json"

    def _check(self, record: dict, path: Path) -> dict:
        if record.get("settings") != self.settings:
            theirs, ours = _flatten(record.get("settings") or {}), _flatten(self.settings)
            diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
            raise SettingsMismatch(f"{path} was made with other settings (differing: {diff}); use another "
                                   "output folder, or the same command as the stored runs")
        return record

    def get(self, key: str) -> dict | None:
        """The stored run ``key`` or ``None``; :class:`SettingsMismatch` when it used other settings."""
        path = self.path(key)
        if not path.exists():
            return None
        return self._check(json.loads(path.read_text(encoding="utf-8")), path)

    def put(self, key: str, record: dict) -> Path:
        """Store a finished run (with the study's settings) atomically; returns its file."""
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        record = dict(record, key=key, settings=self.settings)
        path = self.path(key)
        handle, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.runs_dir)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(record, out, indent=1, default=str)
        os.replace(tmp, path)
        return path

    def records(self) -> list[dict]:
        """Every stored run (sorted by key); :class:`SettingsMismatch` if one used other settings."""
        if not self.runs_dir.is_dir():
            return []
        paths = sorted(self.runs_dir.glob("*.json"))
        return [self._check(json.loads(p.read_text(encoding="utf-8")), p) for p in paths]


# ---------------------------------------------------------------------------------------------------
# Training one run through the recipe
# ---------------------------------------------------------------------------------------------------


# The clocks a run is timed with: curve key -> timer. ``seconds``: wall-clock; ``cpu_seconds``: this process's CPU
# time (all its threads), which other jobs on a shared machine disturb far less.
CLOCKS: dict[str, Callable[[], float]] = {"seconds": time.perf_counter, "cpu_seconds": time.process_time}


class WallClock(TrainerCallback):
    """Records every evaluation as ``{"step", "seconds", "cpu_seconds", "eval_loss"}``: training time so far by the
    wall clock and by the process's CPU time, evaluation time excluded from both; at the end, the totals
    ``train_seconds`` and ``train_cpu_seconds``.

    A second evaluation at a step already recorded (``train_one``'s final ``evaluate``) is not recorded again.
    """

    def __init__(self) -> None:
        self.curve: list[dict] = []
        self.totals = {name: float("nan") for name in CLOCKS}
        self._begin = dict.fromkeys(CLOCKS, 0.0)
        self._mark = dict.fromkeys(CLOCKS, 0.0)
        self._eval = dict.fromkeys(CLOCKS, 0.0)

    @staticmethod
    def _now() -> dict[str, float]:
        return {name: timer() for name, timer in CLOCKS.items()}

    @property
    def train_seconds(self) -> float:
        """Wall-clock training seconds (evaluation excluded)."""
        return self.totals["seconds"]

    @property
    def train_cpu_seconds(self) -> float:
        """CPU seconds of training (evaluation excluded)."""
        return self.totals["cpu_seconds"]

    def on_train_begin(self, args, state, control, **kwargs):
        """Start the clocks."""
        self._begin = self._now()
        self._mark = dict(self._begin)

    def on_step_end(self, args, state, control, **kwargs):
        """Mark the end of an optimiser step (an evaluation, if any, starts now)."""
        self._mark = self._now()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """Record the evaluation (train time up to the step it follows) and discount its duration."""
        now = self._now()
        if metrics is None or "eval_loss" not in metrics:
            return
        if not self.curve or self.curve[-1]["step"] != state.global_step:
            point = {"step": state.global_step}
            point |= {name: self._mark[name] - self._begin[name] - self._eval[name] for name in CLOCKS}
            self.curve.append(point | {"eval_loss": float(metrics["eval_loss"])})
        for name in CLOCKS:
            self._eval[name] += now[name] - self._mark[name]
        self._mark = now

    def on_train_end(self, args, state, control, **kwargs):
        """Total training time without evaluation, by each clock."""
        self.totals = {name: self._mark[name] - self._begin[name] - self._eval[name] for name in CLOCKS}


@dataclass
class RunOutcome:
    """One finished run: the ``train_one`` result plus the wall-clock curve."""

    eval_loss: float
    train_loss: float
    parameters: int
    train_seconds: float
    train_cpu_seconds: float
    tokens_per_second: float
    curve: list
    extra: dict = field(default_factory=dict)

    def as_record(self) -> dict:
        """JSON-ready fields."""
        return asdict(self)


def train_recorded(
    model: PreTrainedModel,
    data: StudyData,
    settings: TrainSettings,
    name: str = "run",
    new_names: Sequence[str] = (),
    new_param_lr_scale: float = 1.0,
    output_dir: str | os.PathLike | None = None,
    test: bool = False,
) -> RunOutcome:
    """Train ``model`` with ``train_one`` (evaluating at step 0 and every ``settings.eval_steps``) and time it.

    Args:
        new_names: parameter names that train at ``new_param_lr_scale`` × the learning rate.
        output_dir: where ``train_one`` saves ``final``; a temporary folder (deleted afterwards) when ``None``.
        test: also evaluate the final model on ``data.test`` (``extra["test_loss"]``).
    Returns:
        the final validation loss, parameters, training wall-clock and CPU seconds without evaluation, train
        tokens/s (wall-clock), and the curve ``[{"step", "seconds", "cpu_seconds", "eval_loss"}]`` from step 0.
    """
    clock = WallClock()
    settings = copy.deepcopy(settings)
    settings.extra = dict(settings.extra, eval_on_start=True, disable_tqdm=True)
    trainer_class = functools.partial(DepthFusionTrainer, callbacks=[clock], new_names=tuple(new_names),
                                      new_param_lr_scale=new_param_lr_scale)
    with tempfile.TemporaryDirectory(prefix="study-run-") as scratch:
        out = Path(output_dir) if output_dir is not None else Path(scratch)
        result = train_one(name, model, data.train, data.validation, out, settings, data.tokenizer,
                           trainer_class=trainer_class)
    tokens = settings.max_steps * settings.batch_size * settings.gradient_accumulation_steps
    tokens *= len(data.train[0]["input_ids"])
    extra = {"trainer_train_seconds": result.train_seconds}
    if test:
        extra["test_loss"] = evaluate_loss(model, data.test, settings)
    return RunOutcome(eval_loss=result.eval_loss, train_loss=result.train_loss, parameters=result.parameters,
                      train_seconds=clock.train_seconds, train_cpu_seconds=clock.train_cpu_seconds,
                      tokens_per_second=tokens / max(clock.train_seconds, 1e-9),
                      curve=clock.curve, extra=extra)


def evaluate_loss(model: PreTrainedModel, dataset, settings: TrainSettings) -> float:
    """The Trainer's evaluation loss of ``model`` on ``dataset`` (as in training: same batching, same loss)."""
    from .clm import training_arguments

    with tempfile.TemporaryDirectory(prefix="study-eval-") as scratch:
        trainer = DepthFusionTrainer(model=model, args=training_arguments(Path(scratch), settings),
                                     eval_dataset=dataset)
        return float(trainer.evaluate()["eval_loss"])


# ---------------------------------------------------------------------------------------------------
# The two grids
# ---------------------------------------------------------------------------------------------------


def build_seeded_pair(spec: ModelSpec, arch: dict, layers: int, seed: int, tokenizer) -> tuple[PreTrainedModel, str]:
    """The model of ``spec`` at ``layers`` blocks whose Llama weights equal the same-seed Llama's.

    The Llama is built first from ``seed``; the family model is then built from ``seed`` too (its own
    initialisation for its new weights: DWA identity, zero pseudo-queries, MoDA's FFN-side K/V projections) and
    the Llama's state dict is loaded into it. Returns the model and ``"shared"``; a family whose parameter names
    or shapes do not fit the Llama's keeps its own seeded initialisation (``"own"``).
    """
    fields = dict(arch, num_hidden_layers=layers)
    set_seed(seed)
    llama = build_model(BASELINE, fields, tokenizer)
    if spec.is_baseline:
        return llama, "shared"
    set_seed(seed)
    config_fields, _ = spec_field_names(spec.kind)
    upcycling_only = sorted(set(spec.fields) - config_fields)
    if upcycling_only:
        raise ValueError(f"model spec {spec.text!r}: {upcycling_only} apply to upcycling only (scripts/upcycle.py); "
                         "a model trained from scratch has no Llama to convert")
    config = build_config(spec.kind, fields, **spec.fields)
    model = build_model(spec.kind, tokenizer=tokenizer, config=config)
    own = model.state_dict()
    llama_state = llama.state_dict()
    if any(k not in own or own[k].shape != v.shape for k, v in llama_state.items()):
        return model, "own"
    model.load_state_dict(llama_state, strict=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model, "shared"


def run_compare_grid(
    specs: Sequence[ModelSpec],
    seeds: Sequence[int],
    layers: Sequence[int],
    arch: dict,
    data: StudyData,
    settings: TrainSettings,
    store: RunStore,
    dataset_label: str,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Train every (depth, seed, model) not yet in ``store``; returns every stored record of the grid.

    Runs go depth by depth, seed by seed, the Llama first, so that an interrupted study has complete pairs.
    """
    ordered = sorted(specs, key=lambda s: not s.is_baseline)
    records = []
    total = len(layers) * len(seeds) * len(ordered)
    done = 0
    for depth in layers:
        for seed in seeds:
            for spec in ordered:
                done += 1
                key = RunStore.key(model=spec.text, layers=depth, seed=seed)
                record = store.get(key)
                if record is not None:
                    log(f"[{done}/{total}] {key}: stored, skipped")
                    records.append(record)
                    continue
                model, init = build_seeded_pair(spec, arch, depth, seed, data.tokenizer)
                run_settings = copy.deepcopy(settings)
                run_settings.seed = seed
                log(f"[{done}/{total}] {key}: training ({init} init)")
                outcome = train_recorded(model, data, run_settings, name=spec.text)
                record = dict(spec=spec.text, name=run_name(model.config), model_type=model.config.model_type,
                              fields=spec.fields, seed=seed, layers=depth, dataset=dataset_label, init=init,
                              **outcome.as_record())
                store.put(key, record)
                log(f"    val loss {outcome.eval_loss:.4f}, {outcome.train_seconds:.0f} s")
                records.append(record)
    return records


def run_continuations(
    specs: Sequence[ModelSpec],
    seeds: Sequence[int],
    lr_scales: Sequence[float],
    llama_path: str | os.PathLike,
    data: StudyData,
    settings: TrainSettings,
    store: RunStore,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Continue the Llama at ``llama_path`` as itself and upcycled to each spec, per seed and new-parameter lr scale.

    The Llama continues at scale 1 only (it has no new parameters); every family is upcycled with its registry
    ``from_llama`` and trained with its new parameters at each scale of ``lr_scales``. Every run evaluates at
    step 0 (the upcycled model before any update) and on the test split at the end.
    """
    from ..convert import load_llama

    records = []
    for seed in seeds:
        for spec in sorted(specs, key=lambda s: not s.is_baseline):
            for scale in ([1.0] if spec.is_baseline else lr_scales):
                key = RunStore.key(model=spec.text, seed=seed, lr_scale=scale)
                record = store.get(key)
                if record is not None:
                    log(f"{key}: stored, skipped")
                    records.append(record)
                    continue
                llama = load_llama(llama_path)
                if spec.is_baseline:
                    model, new = llama, []
                else:
                    family = FAMILIES[spec.kind]
                    if family.from_llama is None:
                        raise ValueError(f"{spec.kind} has no Llama upcycling (its registry entry has no from_llama)")
                    model = family.from_llama(llama, **spec.fields)
                    new = new_parameter_names(model, llama.state_dict())
                run_settings = copy.deepcopy(settings)
                run_settings.seed = seed
                log(f"{key}: training ({len(new)} new parameter tensors at {scale:g}x lr)")
                outcome = train_recorded(model, data, run_settings, name=spec.text, new_names=new,
                                         new_param_lr_scale=scale, test=data.test is not None)
                record = dict(spec=spec.text, name=run_name(model.config), model_type=model.config.model_type,
                              fields=spec.fields, seed=seed, lr_scale=scale, new_parameters=new,
                              **outcome.as_record())
                store.put(key, record)
                log(f"    val loss {outcome.eval_loss:.4f}")
                records.append(record)
    return records


# ---------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------

# Two-sided 95 % quantiles t_{0.975, df} of Student's t for df = 1..30.
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)


def t_quantile_975(df: int) -> float:
    """Student's t 0.975 quantile for ``df`` degrees of freedom (a table to 30, Cornish-Fisher beyond: error < 1e-4).

    Raises:
        ValueError: ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1; got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``nan`` for one value)."""
    values = list(values)
    if not values:
        raise ValueError("mean_std needs at least one value")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")


@dataclass(frozen=True)
class PairedSummary:
    """Paired differences ``model - baseline`` over seeds (negative: the model's loss is lower).

    Attributes:
        n: number of pairs; mean, std: of the differences; low, high: the 95 % t-interval of the mean
        (``nan`` for one pair); won: pairs with a negative difference (the model wins the seed).
    """

    n: int
    mean: float
    std: float
    low: float
    high: float
    won: int


def paired_summary(differences: Sequence[float], higher_is_better: bool = False) -> PairedSummary:
    """Mean, std, 95 % t-interval and seeds won of paired differences.

    A seed is won when its difference is negative (a loss), or positive with ``higher_is_better`` (a score
    such as F1); a tie is not a win.
    """
    mean, std = mean_std(differences)
    n = len(differences)
    half = t_quantile_975(n - 1) * std / math.sqrt(n) if n > 1 else float("nan")
    won = sum((d > 0) if higher_is_better else (d < 0) for d in differences)
    return PairedSummary(n, mean, std, mean - half, mean + half, won)


def interpolate_curve(curve: Sequence[dict], x: float, key: str = "seconds") -> tuple[float, bool]:
    """The eval loss of a curve at ``x`` (``seconds`` or ``step``), linear between evaluations.

    Returns:
        ``(loss, reached)``: ``reached`` is False when ``x`` lies beyond the curve's last point; the loss is then
        the last one (the run ended before the budget: a lower bound on what it would have reached is unknown,
        so this is what it had, not an extrapolation).
    Raises:
        ValueError: an empty curve, or ``x`` before the first point.
    """
    points = sorted((p[key], p["eval_loss"]) for p in curve)
    if not points:
        raise ValueError("the curve is empty")
    if x < points[0][0]:
        raise ValueError(f"{key}={x} lies before the curve's first point ({points[0][0]})")
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return (y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)), True
    return points[-1][1], x <= points[-1][0]


# ---------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------


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
    for depth, rows in compare_summary(records, clock).items():
        lines += [f"## {depth} layers", "",
                  f"| model | seeds | val loss (mean ± std) | Δ at equal steps | won | Δ at equal {budget} | won "
                  "| params | train tokens/s | train s | CPU s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for spec, row in rows.items():
            mean, std = mean_std(row["losses"])
            if "paired" in row:
                paired, wall = row["paired"], row["wall_paired"]
                star = "*" if not all(row["wall_reached"]) else ""
                delta = (f"{_paired(paired)} | {paired.won}/{paired.n} | {_paired(wall)}{star} | "
                         f"{wall.won}/{wall.n}")
            else:
                delta = "— | — | — | —"
            lines.append(f"| {spec} | {len(row['seeds'])} | {_pm(mean, std)} | {delta} | {row['parameters']:,} "
                         f"| {row['tokens_per_second']:,.0f} | {row['train_seconds']:.1f} "
                         f"| {row['train_cpu_seconds']:.1f} |")
        lines += ["", *mean_curve_table([r for r in records if r["layers"] == depth], list(rows)), ""]
    return "\n".join(lines)


def mean_curve_table(records: Sequence[dict], specs: Sequence[str]) -> list[str]:
    """Markdown lines: validation loss at every evaluated step, mean over each spec's runs in ``records``."""
    steps = sorted({p["step"] for r in records for p in r["curve"]})
    lines = ["Validation loss along the way (mean over seeds):", "",
             "| model | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---:|" * len(steps)]
    for spec in specs:
        cells = []
        for step in steps:
            values = [p["eval_loss"] for r in records if r["spec"] == spec for p in r["curve"] if p["step"] == step]
            cells.append(f"{statistics.fmean(values):.4f}" if values else "")
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    return lines


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
             "loss is reported, never used to choose.", "",
             "| model | new-param lr scale | seeds | val loss at step 0 | val loss (mean ± std) | Δ val | won "
             "| test loss (mean ± std) | params |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (spec, scale), row in continuation_summary(records).items():
        mark = " ✓" if chosen.get(spec) == scale else ""
        paired = row.get("paired")
        delta = f"{_paired(paired)} | {paired.won}/{paired.n}" if paired else "— | —"
        tests = [t for t in row["test"] if t is not None]
        test = _pm(*mean_std(tests)) if tests else "—"
        lines.append(f"| {spec} | {scale:g}{mark} | {len(row['seeds'])} | {statistics.fmean(row['start']):.4f} "
                     f"| {_pm(*mean_std(row['losses']))} | {delta} | {test} | {row['parameters']:,} |")
    lines.append("")
    chosen_runs = [r for r in records if r["lr_scale"] == (1.0 if r["spec"] == BASELINE else chosen[r["spec"]])]
    lines += ["At the chosen lr scales:", "", *mean_curve_table(chosen_runs, model_order(records)), ""]
    return "\n".join(lines)


__all__ = [
    "DEFAULT_MODELS",
    "ModelSpec",
    "PairedSummary",
    "RunOutcome",
    "RunStore",
    "SPEC_SHORTHANDS",
    "SettingsMismatch",
    "StudyData",
    "WallClock",
    "best_scales",
    "build_seeded_pair",
    "compare_summary",
    "compare_tables",
    "continuation_summary",
    "continuation_tables",
    "evaluate_loss",
    "interpolate_curve",
    "mean_curve_table",
    "mean_std",
    "model_order",
    "new_parameter_names",
    "paired_summary",
    "parse_model_list",
    "parse_model_spec",
    "prepare_study_data",
    "run_compare_grid",
    "run_continuations",
    "spec_field_names",
    "spec_syntax",
    "t_quantile_975",
    "train_recorded",
]
