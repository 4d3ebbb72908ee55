"""Write self-contained, Hub-ready model folders that load with ``trust_remote_code=True``.

The folder holds the config (with ``auto_map``), the family's code files (configuration, modeling
and op files, copied by transformers), safetensors weights, and optionally the tokenizer and the
generation config. It is written atomically: everything goes to a temporary sibling folder, which
then replaces the target in one rename, so an interrupted export never leaves a half-written folder
in place of a good one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from transformers import PreTrainedModel

# model_type -> (task auto class, base model class name or None)
AUTO_CLASSES: dict[str, tuple[str, str | None]] = {
    "denseformer": ("AutoModelForCausalLM", "DenseFormerModel"),
    "moda": ("AutoModelForCausalLM", "MoDAModel"),
    "dwatt": ("AutoModelForTokenClassification", None),
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
    tokenizer=None,
    model_card: str | None = None,
) -> Path:
    """Write a complete remote-code model folder atomically.

    Args:
        model: a DenseFormer, MoDA or DWAtt model.
        folder: the target folder; an existing one is replaced only once the new one is complete.
        tokenizer: optional tokenizer saved alongside.
        model_card: optional README.md text (Hub model card with YAML front matter).
    Returns:
        The folder's path.
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
        atomic_replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


__all__ = ["AUTO_CLASSES", "register_for_remote_code", "save_remote_code_folder", "atomic_replace_dir"]
