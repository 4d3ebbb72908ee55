"""The export marker: which files a folder written by :mod:`depthfusion_hf.safe_folder` holds, and the file
access that never follows a symlink.

    {"written_by": "depthfusion-hf", "version": "0.1.0", "format": 2, "folder": [2049, 1234567],
     "files": ["config.json", ...], "sha256": {"config.json": "9f86d0...", ...}}

A marker is **untrusted input** (a folder may come from a tarball, a shared drive, a copy). Files are read,
hashed and deleted only through components opened with ``O_NOFOLLOW``: a symlink anywhere on the way makes a
file "not the package's".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MARKER = ".depthfusion-export.json"
WRITER = "depthfusion-hf"
FORMAT = 2
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class ExportTargetError(FileExistsError):
    """The target of an export holds something the package did not write, so it is neither replaced nor touched."""


class MarkerError(ExportTargetError):
    """A folder's export marker claims to be this package's but cannot be trusted; nothing was deleted or written."""


@dataclass(frozen=True)
class Marker:
    """A validated marker: the listed files, their possible hashes (the old and the new one during an in-place
    update) and the ``(st_dev, st_ino)`` of the folder it was written in."""

    files: tuple[str, ...]
    sha256: dict[str, frozenset[str]]
    folder: tuple[int, int]


def sha256_hex(handle: BinaryIO) -> str:
    """The hex sha256 of an open binary file from its position (``hashlib.file_digest`` needs Python 3.11)."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: handle.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()


def _entry_problem(name: object) -> str | None:
    """Why ``name`` cannot be a marker entry (``None`` when it is a plain relative path inside the folder)."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a file name"
    if not name or re.search(r"[\x00-\x1f\x7f\\]", name) or re.match(r"/|[A-Za-z]:", name):
        return "is empty, absolute, or holds a backslash or a control character"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "has an empty, '.' or '..' component (it must name a file inside the folder)"
    return "names the marker itself" if name.split("/")[-1] == MARKER else None


@contextlib.contextmanager
def _no_follow(folder: Path, relative: str):
    """Yield ``(parent folder fd, binary file)`` for the regular file ``relative`` in ``folder``, every component
    opened without following a symlink (and non-blocking: a FIFO never hangs); ``(None, None)`` when one is
    missing, a link or no folder, or the file is no regular file."""
    *folders, name = relative.split("/")
    with contextlib.ExitStack() as stack:
        parent, handle = None, None
        with contextlib.suppress(OSError):
            for index, part in enumerate([os.fspath(folder), *folders]):
                parent = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC,
                                 dir_fd=None if index == 0 else parent)
                stack.callback(os.close, parent)
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=parent)
            handle = stack.enter_context(os.fdopen(fd, "rb"))
        regular = handle is not None and stat.S_ISREG(os.fstat(handle.fileno()).st_mode)
        yield (parent, handle) if regular else (None, None)


def file_sha256(folder: Path, relative: str) -> str | None:
    """The SHA-256 of the regular file ``relative`` in ``folder``; ``None`` when it is missing, a link or behind
    one, not a regular file, or unreadable."""
    with _no_follow(folder, relative) as (_, handle), contextlib.suppress(OSError):
        return sha256_hex(handle) if handle is not None else None
    return None


def remove_if_unchanged(folder: Path, relative: str, hashes: frozenset[str]) -> bool:
    """Delete the regular file ``relative`` in ``folder``, reached without a symlink, when its content has one of
    ``hashes``; True when it was deleted."""
    with _no_follow(folder, relative) as (parent, handle):
        if handle is None or sha256_hex(handle) not in hashes:
            return False
        os.unlink(relative.split("/")[-1], dir_fd=parent)
        return True


def _invalid(path: Path, what: str) -> MarkerError:
    return MarkerError(f"{path} is not a valid export marker: {what}. It was not trusted: nothing was deleted "
                       "or written. Remove or repair it (it lists the files an earlier export wrote).")


def load_marker(folder: Path) -> Marker | None:
    """The validated marker of ``folder``; ``None`` when there is no regular file of that name (a link is not
    followed) or it is not this package's JSON.

    Raises:
        MarkerError: this package's marker of another format than :data:`FORMAT`, or listing anything but plain
            relative names inside the folder, or with malformed hashes or folder identity; the message names the
            marker and the problem.
    """
    path = folder / MARKER
    with _no_follow(folder, MARKER) as (_, handle):
        try:
            data = json.loads(handle.read(16 << 20).decode("utf-8")) if handle is not None else None
        except (OSError, ValueError):  # unreadable, no UTF-8 or no JSON: a foreign file of that name
            return None
    if not isinstance(data, dict) or data.get("written_by") != WRITER:
        return None
    version, files, hashes, identity = (data.get(key) for key in ("format", "files", "sha256", "folder"))
    if version != FORMAT:
        raise _invalid(path, f"its format is {version!r}, and this depthfusion-hf reads format {FORMAT} only (a newer "
                             "version may have written it: upgrade the package)")
    if not isinstance(files, list):
        raise _invalid(path, f"'files' must be a list of file names; got {type(files).__name__}")
    for entry in files:
        if _entry_problem(entry) is not None:
            raise _invalid(path, f"entry {entry!r} {_entry_problem(entry)}")
    if len(set(files)) != len(files):
        raise _invalid(path, "an entry is listed twice")
    if not isinstance(hashes, dict) or set(hashes) != set(files):
        raise _invalid(path, "'sha256' must map every listed file, and only those, to its content hash")
    sha256 = {name: frozenset(value if isinstance(value, list) else [value]) for name, value in hashes.items()}
    for name, values in sha256.items():
        if not values or not all(isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for v in values):
            raise _invalid(path, f"the hash of entry {name!r} is not a SHA-256 hex digest: {hashes[name]!r:.80}")
    if not (isinstance(identity, list) and len(identity) == 2 and all(type(i) is int for i in identity)):
        raise _invalid(path, f"'folder' must be [device, inode]; got {identity!r:.80}")
    return Marker(tuple(files), sha256, (identity[0], identity[1]))


def folder_identity(folder: Path) -> tuple[int, int]:
    info = os.lstat(folder)
    return info.st_dev, info.st_ino


def write_marker(folder: Path, sha256: dict[str, str | frozenset[str]], scratch: Path | None = None) -> None:
    """Write ``folder``'s marker (file -> hash, or possible hashes) atomically, through a temporary file in
    ``scratch`` (same file system; nothing is left in ``folder`` when interrupted) or ``folder``."""
    from . import __version__

    for name in sha256:
        if _entry_problem(name) is not None:  # the package never writes a marker it would refuse to read
            raise ValueError(f"the export would list {name!r}, which {_entry_problem(name)}")
    hashes = {name: value if isinstance(value, str) else sorted(value) for name, value in sorted(sha256.items())}
    data = {"written_by": WRITER, "version": __version__, "format": FORMAT, "folder": list(folder_identity(folder)),
            "files": list(hashes), "sha256": hashes}
    temp = (scratch or folder) / f".marker-{secrets.token_hex(6)}"  # open("x"): the umask applies
    try:
        with open(temp, "x", encoding="utf-8") as out:
            out.write(json.dumps(data, indent=1) + "\n")
        os.replace(temp, folder / MARKER)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
