"""Fixtures shared by the AttnRes tests."""

from __future__ import annotations

import pytest

from .helpers import set_small_numel


@pytest.fixture
def list_path(monkeypatch):
    """The torch backend's forward over the list of sources (not stacked), whatever the size."""
    set_small_numel(monkeypatch, -1)
