#!/usr/bin/env python
"""Export a DenseFormer / MoDA / DWAtt model as a complete Hub-ready folder and upload it.

The folder (written atomically) holds the config with ``auto_map``, the model's code files, safetensors
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
import json
import os
import sys
from pathlib import Path

import transformers
from transformers import AutoConfig, AutoTokenizer

import depthfusion_hf  # noqa: F401  (registers the model types with the Auto classes)
from depthfusion_hf.export import AUTO_CLASSES, clm_results, export_model, push_folder_to_hub


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="a saved model folder (e.g. outputs/clm/denseformer/final)")
    p.add_argument("--config", help="a model config JSON with model_type (configs/*.json); needs --random-init")
    p.add_argument("--random-init", action="store_true", help="build the model from --config with random weights")
    p.add_argument("--repo-id", help="the Hub repo, 'user/name' (needed to upload; named in the card)")
    p.add_argument("--output-dir", help="where to write the export folder (default: exports/<repo name>)")
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
    return args


def load_model(args: argparse.Namespace):
    """The model to export: loaded from the folder, or built from ``--config`` with random weights."""
    if args.model is not None:
        config = AutoConfig.from_pretrained(args.model)
    else:
        fields = json.loads(Path(args.config).read_text())
        fields = {k: v for k, v in fields.items() if not k.startswith("_") and k != "architectures"}
        model_type = fields.pop("model_type", None)
        if model_type not in AUTO_CLASSES:
            raise SystemExit(f"{args.config}: model_type must be one of {sorted(AUTO_CLASSES)}; got {model_type!r}")
        config = AutoConfig.for_model(model_type, **fields)
    if config.model_type not in AUTO_CLASSES:
        raise SystemExit(f"model_type must be one of {sorted(AUTO_CLASSES)}; got {config.model_type!r}")
    auto_class = getattr(transformers, AUTO_CLASSES[config.model_type][0])
    if args.model is not None:
        return auto_class.from_pretrained(args.model)
    return auto_class.from_config(config)


def load_tokenizer(args: argparse.Namespace):
    """``--tokenizer``, else the model folder's tokenizer if it has one, else ``None``."""
    source = args.tokenizer
    if source is None and args.model is not None and (Path(args.model) / "tokenizer_config.json").is_file():
        source = args.model
    return AutoTokenizer.from_pretrained(source) if source is not None else None


def load_results(args: argparse.Namespace, model_type: str) -> list[dict] | None:
    """Metric entries for the card, or ``None`` (random init, ``--results none``, or nothing found)."""
    if args.random_init or args.results == "none":
        return None
    path = Path(args.results) if args.results != "auto" else None
    if path is None:
        candidate = Path(args.model).resolve().parent.parent / "results.json"  # train_clm: <out>/<model>/final
        if not candidate.is_file():
            return None
        path = candidate
        print(f"results: using {path}")
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "runs" in data:
        return clm_results(data, model_type)
    if isinstance(data, list):
        return data
    raise SystemExit(f"{path}: expected a train_clm results.json or a JSON list of metric entries")


def main(argv: list[str] | None = None) -> dict:
    """Write the export folder and upload it when a token is given; returns what was done."""
    args = parse_args(argv)
    model = load_model(args)
    tokenizer = load_tokenizer(args)
    results = load_results(args, model.config.model_type)
    name = args.repo_id.split("/")[-1] if args.repo_id else f"{model.config.model_type}-export"
    folder = Path(args.output_dir) if args.output_dir else Path("exports") / name
    folder = export_model(model, folder, tokenizer=tokenizer, repo_id=args.repo_id, results=results,
                          dataset=args.dataset, trained=not args.random_init)
    print(f"wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}")
    if tokenizer is None:
        print("warning: no tokenizer in the export (give --tokenizer); pipelines need one", file=sys.stderr)
    token = args.token or os.environ.get("HF_TOKEN")
    summary = {"folder": str(folder), "uploaded": False, "url": None, "results": bool(results)}
    if args.dry_run:
        print("dry run: nothing uploaded")
        return summary
    if not token:
        print("no token (--token or $HF_TOKEN): nothing uploaded")
        return summary
    if not args.repo_id:
        raise SystemExit("uploading needs --repo-id user/name")
    url = push_folder_to_hub(folder, args.repo_id, token=token, private=args.private,
                             commit_message=args.commit_message)
    print(f"uploaded to https://huggingface.co/{args.repo_id} ({url})")
    summary.update(uploaded=True, url=url)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
