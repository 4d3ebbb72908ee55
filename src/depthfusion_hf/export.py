"""Exports in one import: remote-code folders, model cards and Hub uploads.

    save_remote_code_folder(model, folder, tokenizer)      # config + code + weights (+ tokenizer)
    export_model(model, folder, tokenizer, repo_id=...)   # the same + model card, then checked
    push_folder_to_hub(folder, repo_id, token=...)        # create the repo, upload the folder

The work is done by :mod:`depthfusion_hf.remote_code` (folders, data-safe through
:mod:`depthfusion_hf.safe_folder`), :mod:`depthfusion_hf.model_card` and :mod:`depthfusion_hf.hub`.
"""

from __future__ import annotations

from .hub import export_model, push_folder_to_hub, upload_problems, validate_repo_id
from .model_card import build_model_card, clm_results, default_model_cards_dir, model_card_values
from .remote_code import (
    TOKENIZER_FILES,
    check_export_folder,
    register_for_remote_code,
    save_model_folder,
    save_remote_code_folder,
)
from .safe_folder import MARKER, ExportTargetError, MarkerError, ReplacedEditedFilesWarning, check_target

__all__ = ["MARKER", "TOKENIZER_FILES", "ExportTargetError", "MarkerError", "ReplacedEditedFilesWarning",
           "build_model_card", "check_export_folder", "check_target", "clm_results", "default_model_cards_dir",
           "export_model", "model_card_values", "push_folder_to_hub", "register_for_remote_code", "save_model_folder",
           "save_remote_code_folder", "upload_problems", "validate_repo_id"]
