"""Model cards: ``model_cards/<family>.md`` rendered with a model's numbers, results as the card's ``model-index``.

    text = build_model_card(model, "me/denseformer-kjv", results=clm_results("outputs/clm/results.json",
                                                                              "denseformer"))

The templates are Jinja templates with Hub front matter (every ``{{ name }}`` must have a value), parsed by
``huggingface_hub.ModelCard``; results become ``EvalResult`` entries of its ``ModelCardData``. The pipeline tag and
the family's numbers come from the family registry (:mod:`depthfusion_hf.families`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub import EvalResult, ModelCard
from transformers import PreTrainedModel

from .families import get_family

RUN_FIELDS = ("model_type", "eval_loss", "perplexity")  # what clm_results reads from each run
# Built-in corpora of ``load_documents`` and what their validation split holds.
BUILTIN_DATASETS = {"kjv": "King James Bible, held-out chapters", "plays": "Shakespeare's plays, held-out passages"}


def default_model_cards_dir() -> Path:
    """The card templates shipped inside the package (``model_cards/`` at the repo root links here)."""
    return Path(__file__).resolve().parent / "model_cards"


def _human(count: int) -> str:
    """``1234567 -> '1.23M'``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return str(count)


def model_card_values(model: PreTrainedModel, repo_id: str, dataset: str | None = None) -> dict[str, Any]:
    """The values a card template refers to: ``repo_id``, ``model_type``, ``architecture``, ``num_parameters``
    (``"1.23M"``), ``num_parameters_exact``, ``dataset``, and the family's own (its registry entry's
    ``card_values``, e.g. DenseFormer's ``dwa_dilation``).

    Raises:
        ValueError: if the model is not one of the registered families.
    """
    family = get_family(model.config.model_type)
    params = sum(p.numel() for p in model.parameters())
    return {"repo_id": repo_id, "model_type": family.model_type, "architecture": type(model).__name__,
            "num_parameters": _human(params), "num_parameters_exact": f"{params:,}",
            "dataset": dataset or family.default_dataset} | family.card_values(model)


def _files_text(files: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(f"{f['name']} (sha256 {f.get('sha256') or 'not recorded'})" for f in files)


def describe_data(data: Mapping[str, Any]) -> dict[str, Any]:
    """The card's dataset fields for a ``results.json`` data record (``recipes.records.data_record``):
    ``dataset_source`` (``"files"``, ``"builtin"``, ``"hub"``), ``dataset_type`` (the Hub id, built-in name or
    ``"local-files"``), ``dataset_name`` (what the validation numbers were measured on, local files by name and
    sha256) and ``dataset_config`` (a Hub dataset's configuration, or ``None``).
    """
    source, name, config = data.get("source"), data.get("name"), data.get("config")
    if source == "files":
        validation = data.get("validation_files")
        held_out = f"validation files {_files_text(validation)}" if validation else "held-out documents"
        kind, config, shown = "local-files", None, f"local files {_files_text(data.get('files') or [])}; {held_out}"
    elif source == "builtin":
        kind, config, shown = name, None, BUILTIN_DATASETS.get(name, f"{name}, held-out documents")
    elif source == "hub":
        kind, shown = name, f"{name}{f' ({config})' if config else ''}, documents held out from its train split"
    else:
        raise ValueError(f"a data record's source must be 'files', 'builtin' or 'hub'; got {source!r}")
    return dict(dataset_source=source, dataset_type=kind, dataset_config=config, dataset_name=shown)


def clm_results(results: str | os.PathLike | Mapping[str, Any], model_type: str) -> list[dict[str, Any]]:
    """Metric entries (see :func:`build_model_card`) for a causal LM from ``scripts/train_clm.py``'s
    ``results.json`` (path or parsed dict): the validation loss and perplexity of the run whose recorded
    ``model_type`` is ``model_type`` (never matched by display name), the Llama baseline's under ``"baseline"``,
    on the dataset the file's ``data`` record names (:func:`describe_data`).

    Raises:
        ValueError: the results lack the ``data`` record or a run's ``model_type``, ``eval_loss`` or
            ``perplexity`` (``train_clm.py`` writes them all), or hold no run of that family.
    """
    data = json.loads(Path(results).read_text()) if not isinstance(results, Mapping) else results
    runs = data.get("runs", [])
    lacking = {run.get("name"): [key for key in RUN_FIELDS if key not in run] for run in runs}
    lacking = {name: keys for name, keys in lacking.items() if keys}
    if not isinstance(data.get("data"), Mapping) or lacking:
        raise ValueError(f"results must be scripts/train_clm.py's results.json: a 'data' record (got "
                         f"{data.get('data')!r:.80}) and runs with {', '.join(RUN_FIELDS)} (runs lacking some: "
                         f"{lacking})")
    run = next((run for run in runs if run["model_type"] == model_type), None)
    if run is None:
        raise ValueError(f"no {model_type!r} run in the results (runs: "
                         f"{[(run.get('name'), run['model_type']) for run in runs]})")
    baseline = next((r for r in runs if r["model_type"] == "llama"), None)
    common = {"task_type": "text-generation", "task_name": "Causal language modeling",
              **describe_data(data["data"]), "dataset_split": "validation", "run": run.get("name"),
              "steps": data.get("settings", {}).get("max_steps")}
    entries = []
    for metric, key in (("loss", "eval_loss"), ("perplexity", "perplexity")):
        entry = common | {"metric_type": metric, "metric_name": f"Validation {metric}"}
        for where, source in (("value", run), ("baseline", baseline)):
            if source is not None:
                entry[where] = round(float(source[key]), 4)
        entries.append(entry)
    return entries


def _results_section(entries: Sequence[Mapping[str, Any]] | None) -> str:
    if not entries:
        return ("No measured results are attached to this export (it was written without a results file, "
                "e.g. a random initialisation); the metadata carries no `model-index`.")
    columns = ["dataset", "metric", "this model"] + ["same-shape Llama"] * any("baseline" in e for e in entries)
    rows = [[e["dataset_name"], e["metric_name"], e["value"], e.get("baseline", "")][:len(columns)] for e in entries]
    lines = [columns, ["---", "---", "---:", "---:"][:len(columns)], *rows]
    steps = next((entry.get("steps") for entry in entries if entry.get("steps")), None)
    note = f"\n\nMeasured by this package's training script ({steps} optimizer steps)." if steps else ""
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines) + note


def build_model_card(model: PreTrainedModel, repo_id: str, results: Sequence[Mapping[str, Any]] | None = None,
                     template_dir: str | os.PathLike | None = None, dataset: str | None = None,
                     trained: bool = True) -> str:
    """Render ``model_cards/<model_type>.md`` for ``model``: numbers from its config, and results if given.

    Args:
        model: a model of a registered family.
        repo_id: the Hub id the card's usage code loads (e.g. ``"me/denseformer-4x5-kjv"``).
        results: metric entries (``task_type``, ``task_name``, ``dataset_type``, ``dataset_name``, optional
            ``dataset_config`` / ``dataset_split``, ``metric_type``, ``metric_name``, ``value``; see
            :func:`clm_results`): the card's ``EvalResult`` ``model-index`` and results table (``None``: none).
        template_dir: folder holding the template; defaults to :func:`default_model_cards_dir`.
        dataset: the training data's Hub id for the ``datasets`` metadata (default: the one the results name;
            local files are named in the text only; without results: the reference run's).
        trained: ``False`` for a random initialisation: the card names no training data and no results.
    Returns:
        The card text (YAML front matter + markdown).
    Raises:
        FileNotFoundError: the template is missing. ValueError: a placeholder has no value, or results for an
            untrained model.
    """
    template = Path(template_dir or default_model_cards_dir()) / get_family(model.config.model_type).card_template
    if not template.is_file():
        raise FileNotFoundError(f"model card template not found: {template}")
    if not trained and results:
        raise ValueError("a randomly initialised model has no measured results")
    measured_on = next((entry for entry in results or () if entry.get("dataset_source")), None)
    local_files = dataset is None and measured_on is not None and measured_on["dataset_source"] == "files"
    if dataset is None and measured_on is not None and not local_files:
        dataset = measured_on["dataset_type"]  # the Hub id or built-in corpus the results were measured on
    values = model_card_values(model, repo_id, dataset=dataset) | {"results_section": _results_section(results)}
    if local_files or not trained:
        values["dataset"] = measured_on["dataset_name"] if trained else "nothing: randomly initialised weights"
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    try:
        card = ModelCard(environment.from_string(template.read_text(encoding="utf-8")).render(values))
    except jinja2.UndefinedError as error:
        raise ValueError(f"model card template {template}: a placeholder has no value ({error})") from error
    if not trained or local_files:  # `datasets` metadata names Hub datasets; local files have none
        card.data.datasets = None
    card.data.model_name = repo_id.rstrip("/").split("/")[-1] if results else None
    fields = ("task_type", "task_name", "dataset_type", "dataset_name", "dataset_config", "dataset_split",
              "metric_type", "metric_name")
    card.data.eval_results = [EvalResult(**{field: entry.get(field) for field in fields}, metric_value=entry["value"])
                              for entry in results or ()] or None
    return str(card)


__all__ = ["build_model_card", "clm_results", "default_model_cards_dir", "describe_data", "model_card_values"]
