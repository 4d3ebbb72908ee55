"""Checks of the few-shot NER recipe's settings (:class:`~depthfusion_hf.recipes.ner.NerSettings`): every value that
cannot give a meaningful experiment is refused at construction, before any model or data is loaded (the
command line, ``scripts/train_ner_fewshot.py``, turns the error into a usage error)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..data import check_data_file

if TYPE_CHECKING:
    from .ner import NerSettings


def _file_problem(name: str, value: str) -> str | None:
    try:
        check_data_file(value, what=name)
    except (OSError, ValueError) as error:
        return str(error)
    return None


def check_settings(settings: NerSettings) -> None:
    """Raise a ValueError naming every setting that cannot give a meaningful experiment.

    Refused: an empty ``sizes`` / ``seeds`` / ``fusions`` (no run), non-integer seeds; ``batch_size`` < 1,
    ``max_length`` < 3 (room for one subword besides ``[CLS]`` / ``[SEP]``: with less, every word would be cut and
    scored ``O``), ``wnut_test_size`` < 1, ``max_test_sentences`` < 0 (0 means all), ``num_threads`` < 0;
    learning rates that are not finite and > 0, a negative or non-finite ``weight_decay`` or ``warmup``,
    ``epochs`` <= 0 when ``max_steps`` <= 0 selects epochs; data given twice (``dataset`` and ``train_file``),
    ``dataset_config`` without ``dataset``, ``validation_file`` without ``train_file``; and a data or
    ``selected_settings`` path that is missing, a folder or no regular file.
    """
    problems = []
    for name in ("sizes", "seeds", "fusions"):
        if not getattr(settings, name):
            problems.append(f"{name} is empty: the grid would hold no run")
    if any(isinstance(seed, bool) or not isinstance(seed, int) for seed in settings.seeds):
        problems.append(f"seeds must be integers; got {settings.seeds}")
    minimums = {"batch_size": 1, "max_length": 3, "wnut_test_size": 1, "max_test_sentences": 0, "num_threads": 0}
    for name, minimum in minimums.items():
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            problems.append(f"{name} must be an integer >= {minimum}; got {value!r}")
    for name, positive in (("learning_rate", True), ("head_learning_rate", True), ("weight_decay", False),
                           ("warmup", False), ("epochs", True)):
        value = getattr(settings, name)
        if name == "epochs" and isinstance(settings.max_steps, int) and settings.max_steps > 0:
            continue  # epochs are used only when max_steps <= 0
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or \
                (value <= 0 if positive else value < 0):
            problems.append(f"{name} must be a finite number {'> 0' if positive else '>= 0'}; got {value!r}")
    if isinstance(settings.max_steps, bool) or not isinstance(settings.max_steps, int):
        problems.append(f"max_steps must be an integer (<= 0: train for epochs); got {settings.max_steps!r}")
    if settings.dataset and settings.train_file:
        problems.append("give either dataset or train_file/test_file, not both")
    if settings.dataset_config and not settings.dataset:
        problems.append("dataset_config needs dataset")
    if settings.validation_file and not settings.train_file:
        problems.append("validation_file needs train_file and test_file")
    for name in ("train_file", "validation_file", "test_file", "selected_settings"):
        value = getattr(settings, name)
        if value:
            problems += [p for p in [_file_problem(name, value)] if p is not None]
    if problems:
        raise ValueError("; ".join(problems))


__all__ = ["check_settings"]
