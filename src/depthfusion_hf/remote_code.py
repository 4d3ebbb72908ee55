"""Write self-contained model folders that load with ``trust_remote_code=True``, and check them.

A folder holds the config (with ``auto_map``), the family's code files (copied by transformers), safetensors
weights and optionally the tokenizer and a model card (``README.md``). It is written by
:func:`~depthfusion_hf.safe_folder.write_folder`: atomically, never replacing what the package did not write.

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


def register_for_remote_code(model: PreTrainedModel) -> None:
    """Mark the model's config and class for ``auto_map`` so ``save_pretrained`` copies the code files, and map
    ``AutoModel`` to the family's base model (transformers' ``custom_object_save`` adds to an existing map).

    Raises:
        ValueError: if the model is not one of this package's families.
    """
    family = get_family(model.config.model_type)
    base = family.base_model_class
    type(model.config).register_for_auto_class()
    is_base = base is not None and type(model).__name__ == base.__name__  # a class loaded from a folder is another
    type(model).register_for_auto_class("AutoModel" if is_base else family.task_auto_class.__name__)
    if base is not None:
        module = type(model).__module__.rsplit(".", 1)[-1]
        model.config.auto_map = {"AutoModel": f"{module}.{base.__name__}"} | (getattr(model.config, "auto_map", None)
                                                                            or {})


def save_remote_code_folder(model: PreTrainedModel, folder: str | os.PathLike, tokenizer: Any = None,
                            model_card: str | None = None, check: bool = False, overwrite: bool = False) -> Path:
    """Save a model folder by :func:`~depthfusion_hf.safe_folder.write_folder`'s rules: a registered family
    (DenseFormer, MoDA, DWAtt, ...) with its code files and ``auto_map``, another model (the Llama baseline) as
    transformers saves it; safetensors weights either way.

    Args:
        model: the model; folder: the target (missing, empty, or a previous export of this package).
        tokenizer: optional tokenizer saved alongside; model_card: optional ``README.md`` text.
        check: run :func:`check_export_folder` on the new folder before it replaces the target.
        overwrite: write into a folder that holds entries this package did not write (they are kept).
    Returns:
        The folder's resolved path.
    Raises:
        ExportTargetError: the target holds what the package did not write (named in the message).
        ValueError: with ``check=True``, the new folder is incomplete (the target is left as it was).
    """
    if model.config.model_type in FAMILIES:
        register_for_remote_code(model)

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if model_card is not None:
            (staging / "README.md").write_text(model_card)

    def problems(staging: Path) -> list[str]:
        return check_export_folder(staging, tokenizer=tokenizer is not None, model_card=model_card is not None)

    return write_folder(folder, write, overwrite=overwrite, check=problems if check else None)




def _read_json(path: Path) -> tuple[dict | None, str | None]:
    """The JSON object in ``path``; otherwise ``None`` and the problem, naming the file."""
    if not path.is_file():  # a pipe would block the read
        return None, f"{path.name} is " + ("a folder, not a file" if path.is_dir() else "a symlink to nothing" if
                                           path.is_symlink() else "not a regular file (a pipe, socket or device)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        return None, f"{path.name} is not valid UTF-8 (byte {error.start}); it must be a UTF-8 JSON file"
    except json.JSONDecodeError as error:
        return None, f"{path.name} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
    except OSError as error:
        return None, f"{path.name} cannot be read: {error.strerror or error}"
    return (data, None) if isinstance(data, dict) else (None, f"{path.name} must hold a JSON object; got "
                                                              f"{type(data).__name__}")


def _code_problems(folder: Path, auto_map: dict) -> list[str]:
    """The ``auto_map`` modules missing or unreadable, and those their single-dot relative imports name (read by
    transformers' ``get_relative_imports``)."""
    problems, seen, pending = [], set(), []
    for name, refs in auto_map.items():
        for ref in refs if isinstance(refs, list) else [refs]:  # a tokenizer's entry is [slow, fast]
            module = str(ref).split("--")[-1].rsplit(".", 1)[0]
            if ref is not None and not re.fullmatch(r"[A-Za-z_]\w*", module):
                problems.append(f"config.json: auto_map[{name!r}] = {ref!r} does not name a module file of the folder")
            elif ref is not None:
                pending.append(module)
    while pending:
        path = folder / f"{pending.pop()}.py"
        if path.name in seen:
            continue
        seen.add(path.name)
        if not path.is_file():  # missing, or no regular file (a read of a pipe would block)
            problems.append(f"code file {path.name} is missing")
            continue
        try:
            pending += get_relative_imports(path)
        except UnicodeDecodeError:
            problems.append(f"code file {path.name} is not valid UTF-8")
        except OSError as error:
            problems.append(f"code file {path.name} cannot be read: {error.strerror or error}")
    return problems


def _weight_problems(folder: Path) -> list[str]:
    """Safetensors weights (one file, or an index whose shards exist inside the folder), no pickle weights."""
    problems = [f"{path.name}: pickle weights; export safetensors only" for path in folder.glob("pytorch_model*.bin")]
    if not os.path.lexists(folder / "model.safetensors.index.json"):
        return problems + ([] if (folder / "model.safetensors").is_file() else ["model.safetensors is missing"])
    index, problem = _read_json(folder / "model.safetensors.index.json")
    shards = index.get("weight_map") if index is not None else None
    if problem is not None:
        return problems + [problem]
    if not isinstance(shards, dict) or not all(isinstance(name, str) for name in shards.values()):
        return problems + ["model.safetensors.index.json: 'weight_map' must map tensor names to shard file names"]
    for name in sorted(set(shards.values())):
        if not re.fullmatch(r"[^/\\\x00]+\.safetensors", name):
            problems.append(f"model.safetensors.index.json names shard {name!r}, not a file name of the folder")
        elif not (folder / name).is_file():
            problems.append(f"weight shard {name} is missing")
    return problems


def check_export_folder(folder: str | os.PathLike, tokenizer: bool = False, model_card: bool = False) -> list[str]:
    """What a remote-code folder lacks, one problem per string; ``[]`` means complete.

    Checked: ``config.json`` with a family's ``model_type`` and an ``auto_map`` naming ``AutoConfig``, the task
    auto class (and ``AutoModel`` where the family has a base model); every code file those modules need;
    safetensors weights and no pickle weights; ``generation_config.json`` for causal LMs; with ``tokenizer`` a
    tokenizer config and vocabulary; with ``model_card`` a ``README.md`` with YAML front matter. A file that is
    no UTF-8 JSON object, a folder, a pipe or a dangling link is a problem naming it (never an exception).
    """
    folder = Path(folder)
    if not os.path.lexists(folder / "config.json"):
        return [f"{folder / 'config.json'} is missing"]
    config, problem = _read_json(folder / "config.json")
    if problem is not None:
        return [f"{folder}: {problem}"]
    family = FAMILIES.get(config.get("model_type")) if isinstance(config.get("model_type"), str) else None
    if family is None:
        return [f"config.json: model_type must be one of {sorted(FAMILIES)}; got {config.get('model_type')!r}"]
    auto_map = config.get("auto_map") or {}
    if not isinstance(auto_map, dict):
        return [f"config.json: auto_map must be an object; got {type(auto_map).__name__}"]
    expected = ["AutoConfig", family.task_auto_class.__name__] + ["AutoModel"] * (family.base_model_class is not None)
    problems = [f"config.json: auto_map has no {name!r} entry" for name in expected if name not in auto_map]
    problems += _code_problems(folder, auto_map) + _weight_problems(folder)
    needed = {"generation_config.json": " (a causal LM)"} if family.is_causal_lm else {}
    for name, why in (needed | ({"tokenizer_config.json": ""} if tokenizer else {})).items():
        problem = _read_json(folder / name)[1] if os.path.lexists(folder / name) else f"{name} is missing{why}"
        problems += [problem] if problem is not None else []
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"no tokenizer vocabulary (one of {TOKENIZER_FILES})")
    if model_card:
        try:
            if not (folder / "README.md").is_file():
                problems.append("README.md (model card) is missing")
            elif metadata_load(folder / "README.md") is None:
                problems.append("README.md: a model card must start with YAML front matter between '---' lines")
        except UnicodeDecodeError:
            problems.append("README.md is not valid UTF-8")
        except (ValueError, yaml.YAMLError) as error:
            problems.append(f"README.md: the front matter is no YAML mapping: {error}")
    return problems


__all__ = ["TOKENIZER_FILES", "check_export_folder", "register_for_remote_code",
           "save_remote_code_folder"]
