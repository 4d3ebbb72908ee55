"""Write self-contained, Hub-ready model folders that load with ``trust_remote_code=True``, and upload them.

The folder holds the config (with ``auto_map``), the family's code files (configuration, modeling
and op files, copied by transformers), safetensors weights, and optionally the tokenizer, the
generation config (causal LMs) and a model card (``README.md``) rendered from
``model_cards/<family>.md``. It is written atomically: everything goes to a temporary sibling folder,
which then replaces the target in one rename, so an interrupted export never leaves a half-written
folder in place of a good one.

    save_remote_code_folder(model, folder, tokenizer)      # config + code + weights (+ tokenizer)
    export_model(model, folder, tokenizer, repo_id=...)   # the same + model card, then checked
    push_folder_to_hub(folder, repo_id, token=...)        # create the repo, upload the folder
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from .families import FAMILIES, get_family

# model_type -> (task auto class name, base model class name or None), read from the family registry
AUTO_CLASSES: dict[str, tuple[str, str | None]] = {
    name: (family.task_auto_class.__name__,
           family.base_model_class.__name__ if family.base_model_class is not None else None)
    for name, family in FAMILIES.items()
}


def register_for_remote_code(model: PreTrainedModel) -> None:
    """Mark the model's config and class for ``auto_map`` so ``save_pretrained`` copies the code files.

    Raises:
        ValueError: if the model is not one of this package's families.
    """
    model_type = model.config.model_type
    if model_type not in AUTO_CLASSES:
        raise ValueError(f"model_type must be one of {sorted(AUTO_CLASSES)}; got {model_type!r}")
    task_auto, base = AUTO_CLASSES[model_type]
    type(model.config).register_for_auto_class()
    type(model).register_for_auto_class("AutoModel" if type(model).__name__ == base else task_auto)


def _add_base_model_entry(folder: Path, model: PreTrainedModel) -> None:
    """Also map ``AutoModel`` to the family's base model in the saved config's ``auto_map``."""
    base = AUTO_CLASSES[model.config.model_type][1]
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    auto_map = config.setdefault("auto_map", {})
    module = type(model).__module__.rsplit(".", 1)[-1]
    if base is not None and "AutoModel" not in auto_map:
        auto_map["AutoModel"] = f"{module}.{base}"
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_replace_dir(staging: Path, target: Path) -> None:
    """Move the finished ``staging`` folder to ``target``, replacing any old one without a gap of junk.

    The old folder is first renamed aside and deleted only after the new one is in place, so at every
    moment ``target`` is either the complete old folder or the complete new one.
    """
    backup = None
    if target.exists():
        backup = target.with_name(f".{target.name}.old-{os.getpid()}")
        if backup.exists():
            shutil.rmtree(backup)
        os.replace(target, backup)
    try:
        os.replace(staging, target)
    except BaseException:
        if backup is not None:
            os.replace(backup, target)
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def save_remote_code_folder(
    model: PreTrainedModel,
    folder: str | os.PathLike,
    tokenizer: Any = None,
    model_card: str | None = None,
    check: bool = False,
) -> Path:
    """Write a complete remote-code model folder atomically.

    Args:
        model: a DenseFormer, MoDA or DWAtt model.
        folder: the target folder; an existing one is replaced only once the new one is complete.
        tokenizer: optional tokenizer saved alongside.
        model_card: optional README.md text (Hub model card with YAML front matter).
        check: run :func:`check_export_folder` on the new folder before it replaces the target.
    Returns:
        The folder's path.
    Raises:
        ValueError: with ``check=True``, if the new folder is incomplete (the target is left as it was).
    """
    target = Path(folder).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    register_for_remote_code(model)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        _add_base_model_entry(staging, model)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if model_card is not None:
            (staging / "README.md").write_text(model_card)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes 0700; give the folder the usual permissions
        if check:
            problems = check_export_folder(staging, tokenizer=tokenizer is not None,
                                           model_card=model_card is not None)
            if problems:
                raise ValueError(f"the export of {target.name} is incomplete: " + "; ".join(problems))
        atomic_replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


# ---------------------------------------------------------------------------------------------------
# Complete Hub folders: checks, model cards, upload
# ---------------------------------------------------------------------------------------------------

PIPELINE_TAGS: dict[str, str] = {name: family.pipeline_tag for name, family in FAMILIES.items()}
# The dataset id put in a card's metadata when the caller names none: the data of the reference runs
# (``scripts/train_clm.py --dataset kjv``, ``scripts/train_ner_fewshot.py`` on WNUT-16).
DEFAULT_DATASETS: dict[str, str] = {name: family.default_dataset for name, family in FAMILIES.items()}
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.([A-Za-z_][A-Za-z0-9_]*)\s+import\s", re.MULTILINE)


def check_export_folder(folder: str | os.PathLike, tokenizer: bool = False, model_card: bool = False) -> list[str]:
    """List what a remote-code folder lacks; an empty list means it is complete.

    Checked: ``config.json`` with ``model_type`` and an ``auto_map`` that has ``AutoConfig`` and the family's
    task auto class (and ``AutoModel`` where the family has a base model); every module named in
    ``auto_map`` and every file those modules import with single-dot relative imports; safetensors weights
    (a single file or an index whose shards all exist) and no pickle weights; ``generation_config.json``
    for causal LMs; with ``tokenizer=True`` a tokenizer config and vocabulary; with ``model_card=True`` a
    ``README.md`` whose YAML front matter parses.
    """
    folder = Path(folder)
    problems: list[str] = []
    config_path = folder / "config.json"
    if not config_path.is_file():
        return [f"{config_path} is missing"]
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if model_type not in AUTO_CLASSES:
        return [f"config.json: model_type must be one of {sorted(AUTO_CLASSES)}; got {model_type!r}"]
    task_auto, base = AUTO_CLASSES[model_type]
    auto_map = config.get("auto_map") or {}
    expected = ["AutoConfig", task_auto] + (["AutoModel"] if base is not None else [])
    problems += [f"config.json: auto_map has no {name!r} entry" for name in expected if name not in auto_map]

    pending = [str(ref).split("--")[-1].split(".")[0] for ref in auto_map.values()]
    seen: set[str] = set()
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        path = folder / f"{module}.py"
        if not path.is_file():
            problems.append(f"code file {path.name} is missing")
            continue
        pending += _RELATIVE_IMPORT.findall(path.read_text())

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        problems += [f"weight shard {name} is missing" for name in sorted(shards) if not (folder / name).is_file()]
    elif not (folder / "model.safetensors").is_file():
        problems.append("model.safetensors is missing")
    pickles = sorted(folder.glob("pytorch_model*.bin"))
    problems += [f"{path.name}: pickle weights; export safetensors only" for path in pickles]
    causal_lm = any(name.endswith("ForCausalLM") for name in config.get("architectures") or [])
    if causal_lm and not (folder / "generation_config.json").is_file():
        problems.append("generation_config.json is missing (a causal LM)")
    if tokenizer:
        if not (folder / "tokenizer_config.json").is_file():
            problems.append("tokenizer_config.json is missing")
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            problems.append(f"no tokenizer vocabulary (one of {TOKENIZER_FILES})")
    if model_card:
        readme = folder / "README.md"
        if not readme.is_file():
            problems.append("README.md (model card) is missing")
        else:
            try:
                split_front_matter(readme.read_text())
            except ValueError as error:
                problems.append(f"README.md: {error}")
    return problems


def default_model_cards_dir() -> Path:
    """The card templates shipped inside the package (``model_cards/`` at the repo root links here)."""
    return Path(__file__).resolve().parent / "model_cards"


def split_front_matter(text: str) -> tuple[dict, str]:
    """Split a model card into its YAML front matter (a dict) and the markdown body.

    Raises:
        ValueError: if the card does not start with a ``---`` block or the block is not a YAML mapping.
    """
    import yaml

    match = re.match(r"\A---[ \t]*\n(.*?\n)---[ \t]*\n(.*)\Z", text, re.DOTALL)
    if match is None:
        raise ValueError("a model card must start with YAML front matter between '---' lines")
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as error:
        raise ValueError(f"the front matter is not valid YAML: {error}") from error
    if not isinstance(meta, dict):
        raise ValueError("the front matter must be a YAML mapping")
    return meta, match.group(2)


def join_front_matter(meta: Mapping[str, Any], body: str) -> str:
    """The inverse of :func:`split_front_matter` (keys keep their order)."""
    import yaml

    return "---\n" + yaml.safe_dump(dict(meta), sort_keys=False, allow_unicode=True) + "---\n" + body


def render_template(text: str, values: Mapping[str, Any]) -> str:
    """Replace every ``{{ name }}`` in ``text`` by ``str(values[name])``.

    Raises:
        ValueError: naming the placeholders that ``values`` lacks (so a typo in a template fails loudly).
    """
    missing = sorted({name for name in _PLACEHOLDER.findall(text) if name not in values})
    if missing:
        raise ValueError(f"model card template placeholders without a value: {missing}")
    return _PLACEHOLDER.sub(lambda match: str(values[match.group(1)]), text)


def _human(count: int) -> str:
    """``1234567 -> '1.23M'``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return str(count)


def model_card_values(model: PreTrainedModel, repo_id: str, dataset: str | None = None) -> dict[str, Any]:
    """The numbers a family's card template refers to, read from the model and its config.

    Common: ``repo_id``, ``model_type``, ``architecture``, ``num_parameters`` (e.g. ``"1.23M"``) and
    ``num_parameters_exact``, ``dataset``, and the config's shape fields. DenseFormer adds ``dwa_dilation``,
    ``dwa_period``, ``num_dwa_weights``, ``dwa_weights_shape``; MoDA ``moda_ffn_kv``, ``norm_position``,
    ``head_dim``, ``max_depth_entries``, ``depth_entries_note``; DWAtt ``backbone_model_type``,
    ``backbone_name``, ``fusion``, ``num_labels``, ``labels``, ``num_states``, ``fusion_num_params``,
    ``depth_embedding_size``, ``bottleneck_ratio``.
    """
    family = get_family(model.config.model_type)
    params = sum(p.numel() for p in model.parameters())
    values: dict[str, Any] = {
        "repo_id": repo_id,
        "model_type": family.model_type,
        "architecture": type(model).__name__,
        "num_parameters": _human(params),
        "num_parameters_exact": f"{params:,}",
        "dataset": dataset or family.default_dataset,
    }
    return values | family.card_values(model)


def clm_results(results: str | os.PathLike | Mapping[str, Any], model_type: str) -> list[dict[str, Any]]:
    """Metric entries for a causal LM from ``scripts/train_clm.py``'s ``results.json`` (path or parsed dict).

    Takes the run whose ``model_type`` is ``model_type`` and the Llama baseline (``model_type`` ``"llama"``);
    returns entries (see :func:`model_index`) for the validation loss and perplexity of the model, with the
    baseline's numbers kept under ``"baseline"`` for the card's results table. Runs are matched by the
    ``model_type`` each run records, never by their display names.

    Raises:
        ValueError: if a run records no ``model_type`` (a file from an older ``train_clm.py``: add the field
            or re-run), or no run of that family is in the file.
    """
    data = json.loads(Path(results).read_text()) if not isinstance(results, Mapping) else results
    runs = data.get("runs", [])
    untyped = [run.get("name") for run in runs if not run.get("model_type")]
    if untyped:
        raise ValueError(f"runs without a 'model_type' field: {untyped} (results written by an older "
                         "train_clm.py; add \"model_type\" to each run or train again)")
    ours = [run for run in runs if run["model_type"] == model_type]
    if not ours:
        raise ValueError(f"no {model_type!r} run in the results (runs: "
                         f"{[(run.get('name'), run['model_type']) for run in runs]})")
    run = ours[0]
    baseline = next((r for r in runs if r["model_type"] == "llama"), None)
    args = data.get("args", {})
    dataset = args.get("dataset") or "local files"
    dataset_name = "King James Bible, held-out chapters" if dataset == "kjv" else f"{dataset} (validation split)"
    steps = data.get("settings", {}).get("max_steps")
    entries = []
    for metric, name, key in (("loss", "Validation loss", "eval_loss"), ("perplexity", "Validation perplexity",
                                                                           "perplexity")):
        value = run.get(key) if key != "perplexity" else run.get(key, math.exp(run["eval_loss"]))
        entry = {
            "task_type": "text-generation",
            "task_name": "Causal language modeling",
            "dataset_type": dataset,
            "dataset_name": dataset_name,
            "dataset_split": "validation",
            "metric_type": metric,
            "metric_name": name,
            "value": round(float(value), 4),
            "run": run.get("name"),
            "steps": steps,
        }
        if baseline is not None:
            entry["baseline"] = round(float(baseline.get(key, math.exp(baseline["eval_loss"]))), 4)
        entries.append(entry)
    return entries


def model_index(model_name: str, entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The Hub ``model-index`` (one result per task/dataset pair) from metric entries.

    Each entry: ``task_type``, ``task_name``, ``dataset_type``, ``dataset_name``, optional ``dataset_split``,
    ``metric_type``, ``metric_name``, ``value``; other keys are ignored.
    """
    results: dict[tuple, dict[str, Any]] = {}
    for entry in entries:
        key = (entry["task_type"], entry["dataset_type"], entry.get("dataset_split"))
        if key not in results:
            dataset = {"name": entry["dataset_name"], "type": entry["dataset_type"]}
            if entry.get("dataset_split"):
                dataset["split"] = entry["dataset_split"]
            results[key] = {"task": {"type": entry["task_type"], "name": entry["task_name"]},
                            "dataset": dataset, "metrics": []}
        results[key]["metrics"].append(
            {"type": entry["metric_type"], "value": entry["value"], "name": entry["metric_name"]}
        )
    return [{"name": model_name, "results": list(results.values())}]


def _results_section(entries: Sequence[Mapping[str, Any]] | None) -> str:
    if not entries:
        return ("No measured results are attached to this export (it was written without a results file, "
                "e.g. a random initialisation); the metadata carries no `model-index`.")
    has_baseline = any("baseline" in entry for entry in entries)
    lines = ["| dataset | metric | this model |" + (" same-shape Llama |" if has_baseline else ""),
             "|---|---|---:|" + ("---:|" if has_baseline else "")]
    for entry in entries:
        row = f"| {entry['dataset_name']} | {entry['metric_name']} | {entry['value']} |"
        if has_baseline:
            row += f" {entry.get('baseline', '')} |"
        lines.append(row)
    steps = next((entry.get("steps") for entry in entries if entry.get("steps")), None)
    note = f"\n\nMeasured by this package's training script ({steps} optimizer steps)." if steps else ""
    return "\n".join(lines) + note


def build_model_card(
    model: PreTrainedModel,
    repo_id: str,
    results: Sequence[Mapping[str, Any]] | None = None,
    template_dir: str | os.PathLike | None = None,
    dataset: str | None = None,
    trained: bool = True,
) -> str:
    """Render ``model_cards/<model_type>.md`` for ``model``: numbers from its config, and results if given.

    Args:
        model: a DenseFormer, MoDA or DWAtt model.
        repo_id: the Hub id the card's usage code loads (e.g. ``"me/denseformer-4x5-kjv"``).
        results: metric entries (see :func:`model_index`, :func:`clm_results`); they become the card's
            ``model-index`` and results table. ``None``: the card claims no results and has no ``model-index``.
        template_dir: folder holding ``<model_type>.md``; defaults to :func:`default_model_cards_dir`.
        dataset: the training data's Hub id for the ``datasets`` metadata (default: the reference run's).
        trained: ``False`` for a random initialisation: the card names no training data and no results.
    Returns:
        The card text (YAML front matter + markdown).
    Raises:
        FileNotFoundError: if the template is missing. ValueError: if a placeholder has no value.
    """
    template_dir = Path(template_dir) if template_dir is not None else default_model_cards_dir()
    template_path = template_dir / get_family(model.config.model_type).card_template
    if not template_path.is_file():
        raise FileNotFoundError(f"model card template not found: {template_path}")
    if not trained and results:
        raise ValueError("a randomly initialised model has no measured results")
    values = model_card_values(model, repo_id, dataset=dataset)
    if not trained:
        values["dataset"] = "nothing: randomly initialised weights"
    values["results_section"] = _results_section(results)
    meta, body = split_front_matter(render_template(template_path.read_text(), values))
    meta.pop("model-index", None)
    if not trained:
        meta.pop("datasets", None)
    if results:
        meta["model-index"] = model_index(repo_id.rstrip("/").split("/")[-1], results)
    return join_front_matter(meta, body)


def export_model(
    model: PreTrainedModel,
    folder: str | os.PathLike,
    tokenizer: Any = None,
    repo_id: str | None = None,
    results: Sequence[Mapping[str, Any]] | None = None,
    template_dir: str | os.PathLike | None = None,
    dataset: str | None = None,
    trained: bool = True,
) -> Path:
    """Write a complete Hub-ready folder atomically: config with ``auto_map``, code, safetensors, tokenizer,
    generation config (causal LMs) and a model card; then check it (:func:`check_export_folder`).

    Args:
        model: a DenseFormer, MoDA or DWAtt model.
        folder: the target; an existing folder is replaced only once the new one is complete.
        tokenizer: saved with the model (the pipelines need it).
        repo_id: the Hub id named in the card (default: ``"<user>/<folder name>"``).
        results, template_dir, dataset, trained: see :func:`build_model_card`.
    Returns:
        The folder's path.
    Raises:
        ValueError: if the written folder is incomplete (the old folder, if any, is left in place).
    """
    target = Path(folder).resolve()
    card = build_model_card(model, repo_id or f"<user>/{target.name}", results=results,
                            template_dir=template_dir, dataset=dataset, trained=trained)
    return save_remote_code_folder(model, target, tokenizer=tokenizer, model_card=card, check=True)


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    commit_message: str = "Upload depthfusion-hf model",
    api: Any = None,
) -> str:
    """Create the model repo ``repo_id`` (if needed) and upload ``folder`` to it in one commit.

    Args:
        folder: an export folder; it must pass :func:`check_export_folder`.
        repo_id: ``"user/name"`` on the Hub.
        token: a Hub token (``None``: the cached login / ``HF_TOKEN``).
        private: create the repo as private (an existing repo keeps its visibility).
        commit_message: the upload commit's message.
        api: an ``huggingface_hub.HfApi`` to use (default: a new one with ``token``).
    Returns:
        The commit URL (or the ``CommitInfo``'s string form).
    Raises:
        ValueError: if the folder is incomplete or ``repo_id`` is not ``"user/name"``.
    """
    folder = Path(folder)
    if not re.fullmatch(r"[\w.\-]+/[\w.\-]+", repo_id or ""):
        raise ValueError(f"repo_id must look like 'user/name'; got {repo_id!r}")
    problems = check_export_folder(folder)
    if problems:
        raise ValueError(f"{folder} is not a complete export: " + "; ".join(problems))
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    api.create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                             token=token, repo_type="model")
    return str(getattr(info, "commit_url", info))


__all__ = [
    "AUTO_CLASSES",
    "PIPELINE_TAGS",
    "atomic_replace_dir",
    "build_model_card",
    "check_export_folder",
    "clm_results",
    "default_model_cards_dir",
    "export_model",
    "model_card_values",
    "model_index",
    "push_folder_to_hub",
    "register_for_remote_code",
    "render_template",
    "save_remote_code_folder",
    "split_front_matter",
]
