#!/usr/bin/env python
"""Export a DenseFormer / MoDA / DWAtt model as a complete Hub-ready folder and upload it.

The folder (written atomically; an existing one is replaced only when it is a previous export of this
package, see ``--overwrite``) holds the config with ``auto_map``, the model's code files, safetensors
weights, the tokenizer, the generation config (causal LMs) and a model card rendered from
``model_cards/<family>.md`` with the config's numbers. It is uploaded with ``huggingface_hub`` when a
token is given (``--token`` or ``$HF_TOKEN``) and ``--dry-run`` is absent; ``--dry-run`` only writes.

    # a model trained by scripts/train_clm.py (its results.json becomes the card's model-index)
    python scripts/push_to_hub.py outputs/clm/denseformer/final --repo-id me/denseformer-kjv --dry-run
    HF_TOKEN=hf_... python scripts/push_to_hub.py outputs/clm/denseformer/final --repo-id me/denseformer-kjv

    # a randomly initialised model from a config (no results are claimed)
    python scripts/push_to_hub.py --config configs/denseformer_48x4x5_paper.json --random-init \
        --repo-id me/denseformer-48x4x5-init --tokenizer outputs/clm/denseformer/final --dry-run
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PreTrainedModel

import depthfusion_hf  # noqa: F401  (registers the model types with the Auto classes)
from depthfusion_hf.data.textfile import read_json_file
from depthfusion_hf.export import export_model, push_folder_to_hub, validate_repo_id
from depthfusion_hf.families import FAMILIES, get_family
from depthfusion_hf.model_card import clm_results
from depthfusion_hf.safe_folder import MARKER, ExportTargetError


def load_export_model(model_folder: str | os.PathLike | None = None,
                      config_path: str | os.PathLike | None = None) -> PreTrainedModel:
    """The model to export: loaded from a saved folder, or built with random weights from a config JSON that
    names its ``model_type`` (``configs/*.json``; keys starting with ``_`` are comments).

    Raises:
        ValueError: if not exactly one source is given, the config file is not a JSON object (naming the file, and
            the line of a JSON error), or the model type is not a registered family.
        FileNotFoundError / IsADirectoryError: the config path is missing or a folder.
    """
    if (model_folder is None) == (config_path is None):
        raise ValueError("give either a model folder or a config file")
    if model_folder is not None:
        config = AutoConfig.from_pretrained(model_folder)
    else:
        fields = read_json_file(config_path)
        if not isinstance(fields, dict):
            raise ValueError(f"{config_path}: a model config must be a JSON object; got {type(fields).__name__}")
        fields = {k: v for k, v in fields.items() if not k.startswith("_") and k != "architectures"}
        model_type = fields.pop("model_type", None)
        if model_type not in FAMILIES:
            raise ValueError(f"{config_path}: model_type must be one of {sorted(FAMILIES)}; got {model_type!r}")
        config = AutoConfig.for_model(model_type, **fields)
    auto_class = get_family(config.model_type).task_auto_class
    if model_folder is not None:
        return auto_class.from_pretrained(model_folder)
    return auto_class.from_config(config)


def load_export_tokenizer(tokenizer: str | None, model_folder: str | os.PathLike | None):
    """``tokenizer`` (a folder / Hub id), else the model folder's tokenizer if it has one, else ``None``."""
    source = tokenizer
    if source is None and model_folder is not None and (Path(model_folder) / "tokenizer_config.json").is_file():
        source = model_folder
    return AutoTokenizer.from_pretrained(source) if source is not None else None


def load_card_results(results: str | os.PathLike | None, model_type: str,
                      model_folder: str | os.PathLike | None = None) -> list[dict] | None:
    """Metric entries for a card: from a ``train_clm.py`` ``results.json`` or a JSON list of entries.

    Args:
        results: the file; ``None`` looks for ``<model_folder>/../../results.json`` (``train_clm.py`` writes
            ``<out>/<model>/final`` and ``<out>/results.json``) and returns ``None`` when there is none.
        model_type: the family whose run to take from a ``results.json``.
        model_folder: the exported model's folder (for the lookup above).
    Raises:
        ValueError: if the file is not JSON (naming the line) or neither form.
        FileNotFoundError / IsADirectoryError: the file is missing or a folder.
    """
    path = Path(results) if results is not None else None
    if path is None:
        if model_folder is None:
            return None
        path = Path(model_folder).resolve().parent.parent / "results.json"
        if not path.is_file():
            return None
    data = read_json_file(path)
    if isinstance(data, dict) and "runs" in data:
        return clm_results(data, model_type)
    if isinstance(data, list):
        return data
    raise ValueError(f"{path}: expected a train_clm results.json or a JSON list of metric entries")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); ``--repo-id`` is validated here, before anything is written."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="a saved model folder (e.g. outputs/clm/denseformer/final)")
    p.add_argument("--config", help="a model config JSON with model_type (configs/*.json); needs --random-init")
    p.add_argument("--random-init", action="store_true", help="build the model from --config with random weights")
    p.add_argument("--repo-id", help="the Hub repo, 'user/name' (needed to upload; named in the card)")
    p.add_argument("--output-dir", help="where to write the export folder (default: exports/<repo name>)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an output folder that holds files this package did not write (they are kept; "
                        "a file with the name of an export file still refuses), replacing files an earlier export "
                        "wrote that were edited since (a warning names them)")
    p.add_argument("--tokenizer", help="tokenizer folder / id (default: the model folder's own, if any)")
    p.add_argument("--results", default="auto",
                   help="results for the card's model-index: a train_clm results.json or a JSON list of metric "
                        "entries; 'auto' (default) uses <folder>/../../results.json when it exists; 'none' omits")
    p.add_argument("--dataset", help="the training data's Hub id for the card's metadata")
    p.add_argument("--token", default=None, help="Hub token (default: $HF_TOKEN); without one nothing is uploaded")
    p.add_argument("--private", action="store_true", help="create the Hub repo as private")
    p.add_argument("--commit-message", default="Upload depthfusion-hf model")
    p.add_argument("--dry-run", action="store_true", help="only write the folder, never upload")
    args = p.parse_args(argv)
    if (args.model is None) == (args.config is None):
        p.error("give either a model folder or --config (with --random-init)")
    if args.config is not None and not args.random_init:
        p.error("--config builds a model with random weights: add --random-init to confirm")
    if args.model is not None and args.random_init:
        p.error("--random-init goes with --config, not with a trained model folder")
    if args.repo_id is not None:
        try:
            validate_repo_id(args.repo_id)
        except ValueError as error:
            p.error(str(error))
    return args


def main(argv: list[str] | None = None) -> dict:
    """Write the export folder and upload it when a token is given; returns what was done."""
    args = parse_args(argv)
    token = args.token or os.environ.get("HF_TOKEN")
    if token and not args.dry_run and not args.repo_id:
        raise SystemExit("uploading needs --repo-id user/name (or --dry-run to only write the folder)")
    try:  # a missing or broken model folder, config, tokenizer or results file: its own message, no traceback
        model = load_export_model(args.model, args.config)
        tokenizer = load_export_tokenizer(args.tokenizer, args.model)
        results = None
        if not args.random_init and args.results != "none":
            source = None if args.results == "auto" else args.results
            results = load_card_results(source, model.config.model_type, model_folder=args.model)
            if results is not None and source is None:
                print(f"results: using {Path(args.model).resolve().parent.parent / 'results.json'}")
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from error
    name = args.repo_id.split("/")[-1] if args.repo_id else f"{model.config.model_type}-export"
    folder = Path(args.output_dir) if args.output_dir else Path("exports") / name
    try:
        folder = export_model(model, folder, tokenizer=tokenizer, repo_id=args.repo_id, results=results,
                              dataset=args.dataset, trained=not args.random_init, overwrite=args.overwrite)
    except ExportTargetError as error:  # MarkerError included: an untrusted marker in the output folder
        raise SystemExit(f"error: {error}") from error
    print(f"wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir() if p.name != MARKER))}")
    if tokenizer is None:
        print("warning: no tokenizer in the export (give --tokenizer); pipelines need one", file=sys.stderr)
    summary = {"folder": str(folder), "uploaded": False, "url": None, "results": bool(results)}
    if args.dry_run:
        print("dry run: nothing uploaded")
        return summary
    if not token:
        print("no token (--token or $HF_TOKEN): nothing uploaded")
        return summary
    try:
        url = push_folder_to_hub(folder, args.repo_id, token=token, private=args.private,
                                 commit_message=args.commit_message)
    except (ExportTargetError, ValueError) as error:
        raise SystemExit(f"error: {error}") from error
    print(f"uploaded to https://huggingface.co/{args.repo_id} ({url})")
    summary.update(uploaded=True, url=url)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
