"""Exports in one import: remote-code folders, model cards and Hub uploads.

The work is done by three modules, each with one job; this module re-exports their public names (and
keeps the family tables that older code imported from here, now read from the family registry):

- :mod:`depthfusion_hf.remote_code`: write and check self-contained ``trust_remote_code`` folders
  (data-safe and atomic through :mod:`depthfusion_hf.safe_folder`);
- :mod:`depthfusion_hf.model_card`: render ``model_cards/<family>.md``, results -> ``model-index``;
- :mod:`depthfusion_hf.hub`: a checked Hub-ready folder with its card, and the upload.

    save_remote_code_folder(model, folder, tokenizer)      # config + code + weights (+ tokenizer)
    export_model(model, folder, tokenizer, repo_id=...)   # the same + model card, then checked
    push_folder_to_hub(folder, repo_id, token=...)        # create the repo, upload the folder
"""

from __future__ import annotations

from .families import FAMILIES
from .hub import export_model, push_folder_to_hub, upload_problems, validate_repo_id
from .model_card import (
    build_model_card,
    clm_results,
    default_model_cards_dir,
    join_front_matter,
    model_card_values,
    model_index,
    render_template,
    split_front_matter,
)
from .remote_code import (
    TOKENIZER_FILES,
    check_export_folder,
    register_for_remote_code,
    save_model_folder,
    save_remote_code_folder,
)
from .safe_folder import MARKER, ExportTargetError, MarkerError, ReplacedEditedFilesWarning, check_target

# Views of the family registry kept for older imports: model_type -> (task auto class, base model class or None)
AUTO_CLASSES: dict[str, tuple[str, str | None]] = {
    name: (family.task_auto_class.__name__,
           family.base_model_class.__name__ if family.base_model_class is not None else None)
    for name, family in FAMILIES.items()
}
PIPELINE_TAGS: dict[str, str] = {name: family.pipeline_tag for name, family in FAMILIES.items()}
DEFAULT_DATASETS: dict[str, str] = {name: family.default_dataset for name, family in FAMILIES.items()}

__all__ = [
    "AUTO_CLASSES",
    "DEFAULT_DATASETS",
    "MARKER",
    "PIPELINE_TAGS",
    "TOKENIZER_FILES",
    "ExportTargetError",
    "MarkerError",
    "ReplacedEditedFilesWarning",
    "build_model_card",
    "check_export_folder",
    "check_target",
    "clm_results",
    "default_model_cards_dir",
    "export_model",
    "join_front_matter",
    "model_card_values",
    "model_index",
    "push_folder_to_hub",
    "register_for_remote_code",
    "render_template",
    "save_model_folder",
    "save_remote_code_folder",
    "split_front_matter",
    "upload_problems",
    "validate_repo_id",
]
