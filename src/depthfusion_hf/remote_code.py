"""Write self-contained model folders that load with ``trust_remote_code=True``, and check them.

The folder holds the config (with ``auto_map``), the family's code files (configuration, modeling and
op files, copied by transformers), safetensors weights, and optionally the tokenizer, the generation
config (causal LMs) and a model card (``README.md``). It is written by :mod:`depthfusion_hf.safe_folder`:
atomically (a half-written export never replaces a good one), marked as this package's export, and
never deleting or replacing what the package did not write.

    save_remote_code_folder(model, folder, tokenizer)   # config + code + weights (+ tokenizer)
    check_export_folder(folder, tokenizer=True)         # [] when complete
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import metadata_load
from transformers import PreTrainedModel
from transformers.dynamic_module_utils import get_relative_imports

from .families import FAMILIES, get_family
from .safe_folder import write_folder

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SHARD = re.compile(r"[^/\\\x00]+\.safetensors")


def register_for_remote_code(model: PreTrainedModel) -> None:
    """Mark the model's config and class for ``auto_map`` so ``save_pretrained`` copies the code files.

    Raises:
        ValueError: if the model is not one of this package's families.
    """
    family = get_family(model.config.model_type)
    base = family.base_model_class
    type(model.config).register_for_auto_class()
    is_base = base is not None and type(model).__name__ == base.__name__
    type(model).register_for_auto_class("AutoModel" if is_base else family.task_auto_class.__name__)


def add_base_model_entry(folder: Path, model: PreTrainedModel) -> None:
    """Also map ``AutoModel`` to the family's base model in the saved config's ``auto_map``."""
    base = get_family(model.config.model_type).base_model_class
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    auto_map = config.setdefault("auto_map", {})
    module = type(model).__module__.rsplit(".", 1)[-1]
    if base is not None and "AutoModel" not in auto_map:
        auto_map["AutoModel"] = f"{module}.{base.__name__}"
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_remote_code_folder(
    model: PreTrainedModel,
    folder: str | os.PathLike,
    tokenizer: Any = None,
    model_card: str | None = None,
    check: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write a complete remote-code model folder (config with ``auto_map``, code, safetensors weights, optionally
    tokenizer and model card) by :func:`~depthfusion_hf.safe_folder.write_folder`'s rules: atomically, and never
    deleting or replacing what the package did not write (docs/RELIABILITY.md §1).

    Args:
        model: a model of a registered family (DenseFormer, MoDA, DWAtt, ...).
        folder: the target: missing, empty, or a previous export of this package.
        tokenizer: optional tokenizer saved alongside.
        model_card: optional README.md text (Hub model card with YAML front matter).
        check: run :func:`check_export_folder` on the new folder before it replaces the target.
        overwrite: write into a folder that holds entries this package did not write (they are kept).
    Returns:
        The folder's resolved path.
    Raises:
        ExportTargetError: the target holds what the package did not write (named in the message).
        ValueError: the model is not of a registered family, or with ``check=True`` the new folder is incomplete
            (the target is left as it was).
    """
    register_for_remote_code(model)

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        add_base_model_entry(staging, model)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if model_card is not None:
            (staging / "README.md").write_text(model_card)

    def problems(staging: Path) -> list[str]:
        return check_export_folder(staging, tokenizer=tokenizer is not None, model_card=model_card is not None)

    return write_folder(folder, write, overwrite=overwrite, check=problems if check else None)


def save_model_folder(
    model: PreTrainedModel, folder: str | os.PathLike, tokenizer: Any = None, overwrite: bool = False
) -> Path:
    """Save any model as :func:`save_remote_code_folder` does: a registered family as a remote-code folder,
    another transformers model (the Llama baseline) with plain ``save_pretrained``; same safety rules.

    Raises:
        ExportTargetError: the target holds what the package did not write (see :func:`save_remote_code_folder`).
    """
    if model.config.model_type in FAMILIES:
        return save_remote_code_folder(model, folder, tokenizer=tokenizer, overwrite=overwrite)

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)

    return write_folder(folder, write, overwrite=overwrite)


def _read_json(path: Path) -> tuple[dict | None, str | None]:
    """The JSON object in ``path``; otherwise ``None`` and the problem, naming the file."""
    if path.is_symlink() and not path.exists():
        return None, f"{path.name} is a symlink to nothing ({os.readlink(path)})"
    if path.is_dir():
        return None, f"{path.name} is a folder, not a file"
    if not path.is_file():  # a pipe would block the read
        return None, f"{path.name} is not a regular file (a pipe, socket or device)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        return None, f"{path.name} is not valid UTF-8 (byte {error.start}); it must be a UTF-8 JSON file"
    except json.JSONDecodeError as error:
        return None, f"{path.name} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
    except OSError as error:
        return None, f"{path.name} cannot be read: {error.strerror or error}"
    if not isinstance(data, dict):
        return None, f"{path.name} must hold a JSON object; got {type(data).__name__}"
    return data, None


def check_export_folder(folder: str | os.PathLike, tokenizer: bool = False, model_card: bool = False) -> list[str]:
    """List what a remote-code folder lacks; an empty list means it is complete.

    Checked: ``config.json`` (a JSON object) with ``model_type`` and an ``auto_map`` that has ``AutoConfig`` and
    the family's task auto class (and ``AutoModel`` where the family has a base model); every module named in
    ``auto_map`` and every file those modules import with single-dot relative imports; safetensors weights
    (a single file or an index whose shards all exist) and no pickle weights; ``generation_config.json``
    for causal LMs; with ``tokenizer=True`` a tokenizer config and vocabulary; with ``model_card=True`` a
    ``README.md`` whose YAML front matter parses. A file that is not valid UTF-8 JSON, not the JSON kind it
    must be, a folder or a dangling symlink is a problem naming it (never an exception).
    """
    folder = Path(folder)
    problems: list[str] = []
    config_path = folder / "config.json"
    if not os.path.lexists(config_path):
        return [f"{config_path} is missing"]
    config, problem = _read_json(config_path)
    if problem is not None:
        return [f"{folder}: {problem}"]
    family = FAMILIES.get(config.get("model_type")) if isinstance(config.get("model_type"), str) else None
    if family is None:
        return [f"config.json: model_type must be one of {sorted(FAMILIES)}; got {config.get('model_type')!r}"]
    auto_map = config.get("auto_map") or {}
    if not isinstance(auto_map, dict):
        return [f"config.json: auto_map must be an object; got {type(auto_map).__name__}"]
    expected = ["AutoConfig", family.task_auto_class.__name__]
    expected += ["AutoModel"] if family.base_model_class is not None else []
    problems += [f"config.json: auto_map has no {name!r} entry" for name in expected if name not in auto_map]

    pending = []
    for name, refs in auto_map.items():
        for ref in refs if isinstance(refs, list) else [refs]:  # a tokenizer's entry is [slow, fast]
            module = str(ref).split("--")[-1].rsplit(".", 1)[0]
            if ref is not None and not _MODULE.fullmatch(module):
                problems.append(f"config.json: auto_map[{name!r}] = {ref!r} does not name a module file of the folder")
            elif ref is not None:
                pending.append(module)
    seen: set[str] = set()
    while pending:  # every module auto_map names, and what they import (read by transformers' own helper)
        module = pending.pop()
        path = folder / f"{module}.py"
        if module in seen:
            continue
        seen.add(module)
        if not path.is_file():
            problems.append(f"code file {path.name} is missing")
            continue
        try:
            pending += get_relative_imports(path)
        except UnicodeDecodeError:
            problems.append(f"code file {path.name} is not valid UTF-8")
        except OSError as error:
            problems.append(f"code file {path.name} cannot be read: {error.strerror or error}")

    index_path = folder / "model.safetensors.index.json"
    if os.path.lexists(index_path):
        index, problem = _read_json(index_path)
        weight_map = index.get("weight_map") if index is not None else None
        if problem is not None:
            problems.append(problem)
        elif not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            problems.append("model.safetensors.index.json: 'weight_map' must map tensor names to shard file names")
        else:
            for name in sorted(set(weight_map.values())):
                if not _SHARD.fullmatch(name):
                    problems.append(f"model.safetensors.index.json names shard {name!r}, which is not a file name of "
                                    "the folder")
                elif not (folder / name).is_file():
                    problems.append(f"weight shard {name} is missing")
    elif not (folder / "model.safetensors").is_file():
        problems.append("model.safetensors is missing")
    pickles = sorted(folder.glob("pytorch_model*.bin"))
    problems += [f"{path.name}: pickle weights; export safetensors only" for path in pickles]
    needed = {"generation_config.json": " (a causal LM)"} if family.is_causal_lm else {}
    needed |= {"tokenizer_config.json": ""} if tokenizer else {}
    for name, why in needed.items():
        problem = _read_json(folder / name)[1] if os.path.lexists(folder / name) else f"{name} is missing{why}"
        problems += [problem] if problem is not None else []
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"no tokenizer vocabulary (one of {TOKENIZER_FILES})")
    if model_card:
        readme = folder / "README.md"
        try:
            if not readme.is_file():
                problems.append("README.md (model card) is missing")
            elif metadata_load(readme) is None:
                problems.append("README.md: a model card must start with YAML front matter between '---' lines")
        except UnicodeDecodeError:
            problems.append("README.md is not valid UTF-8")
        except (ValueError, yaml.YAMLError) as error:
            problems.append(f"README.md: the front matter is no YAML mapping: {error}")
    return problems


__all__ = ["TOKENIZER_FILES", "add_base_model_entry", "check_export_folder", "register_for_remote_code",
           "save_model_folder", "save_remote_code_folder"]
