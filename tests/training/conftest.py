"""Fixtures for the training tests: a small slice of the built-in corpus as a local text file."""

from __future__ import annotations

import pytest

from depthfusion_hf.data.corpus import load_documents


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    """60 chapters of the King James Bible as a ``.txt`` file (chapters separated by blank lines)."""
    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text("\n\n".join(load_documents()[:60]), encoding="utf-8")
    return path
