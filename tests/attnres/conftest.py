"""Fixtures shared by the AttnRes tests of the torch backend's training path."""

from __future__ import annotations

import pytest

from depthfusion_hf.models.attnres import shared_sources

from .helpers import set_small_numel


@pytest.fixture
def list_path(monkeypatch):
    """The torch backend's list path (and so the logit rows), whatever the size."""
    set_small_numel(monkeypatch, -1)


@pytest.fixture
def row_calls(monkeypatch):
    """Counts the calls run from logit rows."""
    count = {"rows": 0}
    original = shared_sources._MixFromRows.apply

    def counting(*args):
        count["rows"] += 1
        return original(*args)

    monkeypatch.setattr(shared_sources._MixFromRows, "apply", counting)
    return count
