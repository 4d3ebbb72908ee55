"""Fixtures for the training tests: a small slice of the built-in corpus, and single-process reference runs."""

from __future__ import annotations

import pytest

from depthfusion_hf.data.corpus import load_documents


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    """60 chapters of the King James Bible as a ``.txt`` file (chapters separated by blank lines)."""
    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text("\n\n".join(load_documents()[:60]), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def single_process_run(tmp_path_factory, corpus_file):
    """``(family, backbone="llama") -> (results, output folder)`` of the one-process run on the global batch (computed
    once per pair).

    The reference the 2-rank DDP and FSDP runs of ``tests/training/launch.py`` are compared with.
    """
    from .launch import single_process

    runs: dict[tuple[str, str], tuple[dict, object]] = {}

    def run(family: str, backbone: str = "llama"):
        if (family, backbone) not in runs:
            out = tmp_path_factory.mktemp(f"single_{family}_{backbone}")
            runs[family, backbone] = (single_process(corpus_file, family, out, backbone=backbone), out)
        return runs[family, backbone]

    return run
