"""Exports in one import: remote-code folders, model cards, Hub-ready exports and their upload to the Hub.

    save_remote_code_folder(model, folder, tokenizer)      # config + code + weights (+ tokenizer)
    export_model(model, folder, tokenizer, repo_id=...)   # the same + model card, then checked
    push_folder_to_hub(folder, repo_id, token=...)        # create the repo, upload the folder

Folders are written by :mod:`depthfusion_hf.remote_code` (data-safe through :mod:`depthfusion_hf.safe_folder`),
cards by :mod:`depthfusion_hf.model_card`; ``scripts/push_to_hub.py`` is the command-line front end.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from .model_card import build_model_card, clm_results, default_model_cards_dir, model_card_values
from .remote_code import (
    TOKENIZER_FILES,
    check_export_folder,
    register_for_remote_code,
    save_model_folder,
    save_remote_code_folder,
)
from .safe_folder import MARKER, ExportTargetError, MarkerError, ReplacedEditedFilesWarning, check_target, load_marker

_REPO_ID = re.compile(r"[\w.\-]+/[\w.\-]+")
MARKER_PATTERNS = [MARKER, f"*/{MARKER}"]  # the marker at the top and in any sub-folder (`*` crosses '/')


def validate_repo_id(repo_id: str | None) -> str:
    """Return ``repo_id`` when it has the Hub's ``"user/name"`` form and passes the Hub's own name rules.

    Raises:
        ValueError: naming the id when it does not (e.g. ``"me/.."``, ``"me/a--b"``: the last part also names the
            default export folder).
    """
    if not isinstance(repo_id, str) or not _REPO_ID.fullmatch(repo_id):
        raise ValueError(f"repo_id must look like 'user/name' (letters, digits, '_', '-', '.'); got {repo_id!r}")
    from huggingface_hub.utils import HFValidationError
    from huggingface_hub.utils import validate_repo_id as hub_rules

    try:
        hub_rules(repo_id)
    except HFValidationError as error:
        raise ValueError(f"repo_id {repo_id!r} is not a valid Hub id: {error}") from error
    return repo_id


def export_model(
    model: PreTrainedModel,
    folder: str | os.PathLike,
    tokenizer: Any = None,
    repo_id: str | None = None,
    results: Sequence[Mapping[str, Any]] | None = None,
    template_dir: str | os.PathLike | None = None,
    dataset: str | None = None,
    trained: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write a complete Hub-ready folder atomically: config with ``auto_map``, code, safetensors, tokenizer,
    generation config (causal LMs) and a model card; then check it (:func:`check_export_folder`).

    The target rules are :func:`~depthfusion_hf.remote_code.save_remote_code_folder`'s: a missing or empty
    folder or a previous export of this package is replaced; anything else raises ``ExportTargetError``
    unless ``overwrite=True``, which keeps every entry the package did not write.

    Args:
        model: a model of a registered family.
        folder: the target.
        tokenizer: saved with the model (the pipelines need it).
        repo_id: the Hub id named in the card (default: ``"<user>/<folder name>"``); validated first.
        results, template_dir, dataset, trained: see :func:`~depthfusion_hf.model_card.build_model_card`.
        overwrite: write into a folder that holds entries this package did not write (they are kept).
    Returns:
        The folder's resolved path.
    Raises:
        ValueError: a malformed ``repo_id`` (before anything is written), or the written folder is incomplete
            (the old folder, if any, is left in place).
        ExportTargetError: the target holds what the package did not write.
    """
    if repo_id is not None:
        validate_repo_id(repo_id)
    target = Path(folder).resolve()
    card = build_model_card(model, repo_id or f"<user>/{target.name}", results=results,
                            template_dir=template_dir, dataset=dataset, trained=trained)
    return save_remote_code_folder(model, folder, tokenizer=tokenizer, model_card=card, check=True,
                                   overwrite=overwrite)


def upload_problems(folder: Path) -> list[str]:
    """Why ``folder`` may not be uploaded as it is: a symlink that leads out of it (its target's content would be
    uploaded under the link's name), a pipe, socket or device; an untrusted marker raises.

    Raises:
        MarkerError: the folder's marker claims to be this package's but lists a path outside the folder.
    """
    load_marker(folder)  # the same trust rules as an export: a marker that lists outside paths is refused
    root = folder.resolve()
    problems = []
    for current, dirs, names in os.walk(folder):
        for name in sorted(names + dirs):
            path = Path(current) / name
            relative = path.relative_to(folder).as_posix()
            if path.is_symlink():
                target = path.resolve()
                if target != root and root not in target.parents:
                    problems.append(f"{relative} is a symlink to {os.readlink(path)}, outside the folder (its content "
                                    "would be uploaded); replace it with the file itself")
            elif not (path.is_file() or path.is_dir()):
                problems.append(f"{relative} is not a regular file (a pipe, socket or device)")
    return problems


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    commit_message: str = "Upload depthfusion-hf model",
    api: Any = None,
) -> str:
    """Create the model repo ``repo_id`` (if needed) and upload ``folder`` to it in one commit.

    The export marker (``.depthfusion-export.json``, local bookkeeping, at any depth) is never uploaded. The
    folder is checked before any Hub call: it must pass :func:`check_export_folder`, its marker (if any) must be
    trustworthy (the rules of :mod:`depthfusion_hf.safe_folder`), and it may hold no symlink leading out of it
    and no pipe, socket or device (:func:`upload_problems`).

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
        ValueError: if ``folder`` is not a folder, is incomplete or holds what may not be uploaded, or ``repo_id``
            is not ``"user/name"``.
        MarkerError: an untrusted marker.
    """
    folder = Path(folder)
    validate_repo_id(repo_id)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder" + ("" if folder.exists() else " (it does not exist)"))
    problems = check_export_folder(folder) + upload_problems(folder)
    if problems:
        raise ValueError(f"{folder} is not a complete export that can be uploaded: " + "; ".join(problems))
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    api.create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                             token=token, repo_type="model", ignore_patterns=MARKER_PATTERNS)
    return str(getattr(info, "commit_url", info))


__all__ = ["MARKER", "MARKER_PATTERNS", "TOKENIZER_FILES", "ExportTargetError", "MarkerError",
           "ReplacedEditedFilesWarning", "build_model_card", "check_export_folder", "check_target", "clm_results",
           "default_model_cards_dir", "export_model", "model_card_values", "push_folder_to_hub",
           "register_for_remote_code", "save_model_folder", "save_remote_code_folder", "upload_problems",
           "validate_repo_id"]
