"""Exports in one import: remote-code folders, model cards, Hub-ready exports and their upload to the Hub.

    save_remote_code_folder(model, folder, tokenizer)      # config + code + weights (+ tokenizer)
    export_model(model, folder, tokenizer, repo_id=...)   # the same + model card, then checked
    push_folder_to_hub(folder, repo_id, token=...)        # create the repo, upload the folder

``scripts/push_to_hub.py`` is the command-line front end.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub.utils import HFValidationError
from huggingface_hub.utils import validate_repo_id as hub_repo_id_rules
from transformers import PreTrainedModel

from .model_card import build_model_card, clm_results, default_model_cards_dir, model_card_values
from .remote_code import TOKENIZER_FILES, check_export_folder, register_for_remote_code, save_remote_code_folder
from .safe_folder import MARKER, ExportTargetError, MarkerError, ReplacedEditedFilesWarning, check_target, load_marker

MARKER_PATTERNS = [MARKER, f"*/{MARKER}"]  # the marker at the top and in any sub-folder (`*` crosses '/')


def validate_repo_id(repo_id: str | None) -> str:
    """Return ``repo_id`` when it is ``"user/name"`` and passes the Hub's own name rules (its last part also names
    the default export folder: ``"me/.."`` must not pass).

    Raises:
        ValueError: naming the id and the rule it breaks.
    """
    try:
        if not isinstance(repo_id, str) or repo_id.count("/") != 1:
            raise HFValidationError("it needs exactly one '/'")
        hub_repo_id_rules(repo_id)
    except HFValidationError as error:
        raise ValueError(f"repo_id must look like 'user/name' (letters, digits, '_', '-', '.') and be a valid Hub id; "
                         f"got {repo_id!r}: {error}") from error
    return repo_id


def export_model(model: PreTrainedModel, folder: str | os.PathLike, tokenizer: Any = None, repo_id: str | None = None,
                 results: Sequence[Mapping[str, Any]] | None = None, template_dir: str | os.PathLike | None = None,
                 dataset: str | None = None, trained: bool = True, overwrite: bool = False) -> Path:
    """Write a complete, checked Hub-ready folder (:func:`save_remote_code_folder`'s rules) with a model card.

    Args:
        model, folder, tokenizer, overwrite: see :func:`save_remote_code_folder`.
        repo_id: the Hub id named in the card (default: ``"<user>/<folder name>"``); validated first.
        results, template_dir, dataset, trained: see :func:`~depthfusion_hf.model_card.build_model_card`.
    Returns:
        The folder's resolved path.
    Raises:
        ValueError: a malformed ``repo_id`` (before anything is written), or the written folder is incomplete
            (the old folder, if any, is left in place). ExportTargetError: see :func:`save_remote_code_folder`.
    """
    repo_id = validate_repo_id(repo_id) if repo_id is not None else f"<user>/{Path(folder).resolve().name}"
    card = build_model_card(model, repo_id, results=results, template_dir=template_dir, dataset=dataset,
                            trained=trained)
    return save_remote_code_folder(model, folder, tokenizer, model_card=card, check=True, overwrite=overwrite)


def upload_problems(folder: Path) -> list[str]:
    """Why ``folder`` may not be uploaded as it is: a symlink leading out of it (its target's content would be
    uploaded under the link's name), a pipe, socket or device.

    Raises:
        MarkerError: the folder's marker cannot be trusted (the rules of an export).
    """
    load_marker(folder)
    root, problems = folder.resolve(), []
    for path in sorted(folder.rglob("*")):  # links to folders are listed, not followed
        relative = path.relative_to(folder).as_posix()
        if path.is_symlink() and root != path.resolve() and root not in path.resolve().parents:
            problems.append(f"{relative} is a symlink to {os.readlink(path)}, outside the folder (its content "
                            "would be uploaded); replace it with the file itself")
        elif not path.is_symlink() and not (path.is_file() or path.is_dir()):
            problems.append(f"{relative} is not a regular file (a pipe, socket or device)")
    return problems


def push_folder_to_hub(folder: str | os.PathLike, repo_id: str, token: str | None = None, private: bool = False,
                       commit_message: str = "Upload depthfusion-hf model", api: Any = None) -> str:
    """Create the model repo ``repo_id`` (if needed) and upload ``folder`` in one commit, without the marker.

    Before any Hub call the folder must pass :func:`check_export_folder` and :func:`upload_problems`.

    Args:
        folder: an export folder. repo_id: ``"user/name"`` on the Hub.
        token: a Hub token (``None``: the cached login / ``HF_TOKEN``).
        private: create the repo as private (an existing repo keeps its visibility).
        commit_message: the upload commit's message. api: the ``HfApi`` to use (default: a new one).
    Returns:
        The commit URL.
    Raises:
        ValueError: ``folder`` is no folder, is incomplete or holds what may not be uploaded, or a bad ``repo_id``.
        MarkerError: an untrusted marker.
    """
    folder = Path(folder)
    validate_repo_id(repo_id)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder" + ("" if folder.exists() else " (it does not exist)"))
    problems = check_export_folder(folder) + upload_problems(folder)
    if problems:
        raise ValueError(f"{folder} is not a complete export that can be uploaded: " + "; ".join(problems))
    api = api or huggingface_hub.HfApi(token=token)  # looked up now: tests replace it
    api.create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                             token=token, repo_type="model", ignore_patterns=MARKER_PATTERNS)
    return str(getattr(info, "commit_url", info))


__all__ = ["MARKER", "MARKER_PATTERNS", "TOKENIZER_FILES", "ExportTargetError", "MarkerError",
           "ReplacedEditedFilesWarning", "build_model_card", "check_export_folder", "check_target", "clm_results",
           "default_model_cards_dir", "export_model", "model_card_values", "push_folder_to_hub",
           "register_for_remote_code", "save_remote_code_folder", "upload_problems",
           "validate_repo_id"]
