"""What runs record: a causal-LM run's data in ``results.json`` (model cards read it; see ``model_card``), and the
markdown tables of the recipes' reports."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..data.corpus import BUILTIN_CORPORA, BUILTIN_CORPUS
from ..data.textfile import file_sha256


def data_record(
    dataset: str | None = None,
    dataset_config: str | None = None,
    train_files: Sequence[str | os.PathLike] | None = None,
    validation_files: Sequence[str | os.PathLike] | None = None,
    validation_fraction: float | None = None,
) -> dict:
    """What a run trained and evaluated on, as ``results.json`` records it and model cards read it.

    ``{"source": "files" | "builtin" | "hub", "name", "config", "files": [{"name", "sha256"}],
    "validation_files": [{"name", "sha256"}], "validation_fraction"}``: local files by name and hash (``dataset`` is
    then unused, whatever its default), a built-in corpus by name, a Hub dataset by id and configuration. The
    validation data is the files given, or the last ``validation_fraction`` of the documents.
    """
    def files(paths):
        return [{"name": Path(path).name, "sha256": file_sha256(path)} for path in paths or ()]

    if train_files:
        record = {"source": "files", "name": ", ".join(Path(path).name for path in train_files), "config": None}
    elif dataset in (None, *BUILTIN_CORPORA):
        record = {"source": "builtin", "name": dataset or BUILTIN_CORPUS, "config": None}
    else:
        record = {"source": "hub", "name": dataset, "config": dataset_config}
    return record | {"files": files(train_files), "validation_files": files(validation_files),
                     "validation_fraction": None if validation_files else validation_fraction}


def table_lines(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a markdown table: ``header``, then one line per row; the first column left-aligned, the others
    right-aligned (numbers)."""
    return [f"| {' | '.join(header)} |", "|---|" + "---:|" * (len(header) - 1),
            *(f"| {' | '.join(map(str, row))} |" for row in rows)]


__all__ = ["BUILTIN_CORPORA", "data_record", "file_sha256", "table_lines"]
