"""The export marker: what a folder written by :mod:`depthfusion_hf.safe_folder` holds, and how it is trusted.

Every folder the package writes holds :data:`MARKER`, a JSON file listing the files the package wrote with
their SHA-256 content hashes and the identity (device, inode) of the folder it was written in::

    {"written_by": "depthfusion-hf", "version": "0.1.0", "format": 2, "folder": [2049, 1234567],
     "files": ["config.json", ...], "sha256": {"config.json": "9f86d0...", ...}}

A marker is **untrusted input** (a folder may come from a tarball, a shared drive, a copy): :func:`load_marker`
refuses, with :class:`MarkerError` naming the marker and the entry, a marker that says it was written by
this package but lists anything other than plain relative names inside the folder (absolute paths, ``..``,
``.``, empty components, backslashes, control characters, the marker itself, duplicates), or whose hashes
or folder identity are malformed. Files are only ever read, hashed and deleted through
:func:`file_sha256` / :func:`remove_if_unchanged`, which open every path component with ``O_NOFOLLOW``:
a symlink anywhere on the way (a listed ``sub/a.txt`` whose ``sub`` now links elsewhere) makes the file
"not the package's", so nothing outside the folder is ever read for a decision or deleted.

A marker of format 1 (before content hashes; no ``format`` key) is still read; its files cannot be told
from edited ones, so :mod:`~depthfusion_hf.safe_folder` treats every one of them as possibly edited.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARKER = ".depthfusion-export.json"
WRITER = "depthfusion-hf"
FORMAT = 2
_HASH = re.compile(r"[0-9a-f]{64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ExportTargetError(FileExistsError):
    """The target of an export holds something the package did not write, so it is neither replaced nor touched."""


class MarkerError(ExportTargetError):
    """A folder's export marker claims to be this package's but cannot be trusted; nothing was deleted or written."""


@dataclass(frozen=True)
class Marker:
    """A marker read by :func:`load_marker`.

    Attributes:
        files: the relative POSIX paths the package wrote (validated: plain names inside the folder).
        sha256: for each file, the content hashes it may have (one, or two while an in-place update runs);
            ``None`` for a format-1 marker, which recorded none.
        folder: ``(st_dev, st_ino)`` of the folder the marker was written in (``None`` for format 1).
    """

    files: tuple[str, ...]
    sha256: dict[str, frozenset[str]] | None
    folder: tuple[int, int] | None

    @property
    def legacy(self) -> bool:
        """Written before content hashes were recorded (format 1)."""
        return self.sha256 is None


def entry_problem(name: object) -> str | None:
    """Why ``name`` cannot be a marker entry (``None`` when it is a plain relative path inside the folder)."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a file name"
    if not name:
        return "is empty"
    if _CONTROL.search(name):
        return "holds a control character"
    if "\\" in name:
        return "holds a backslash (entries use '/' between folders)"
    if name.startswith("/") or re.match(r"[A-Za-z]:", name):
        return "is an absolute path"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' component (it must name a file inside the folder)"
    if parts[-1] == MARKER:
        return "names the marker itself"
    return None


def _problem(path: Path, what: str) -> MarkerError:
    return MarkerError(f"{path} is not a valid export marker: {what}. It was not trusted: nothing was deleted "
                       "or written. Remove or repair it (it lists the files an earlier export wrote).")


def load_marker(folder: Path) -> Marker | None:
    """The marker of ``folder``, validated; ``None`` when there is none or it is not this package's.

    ``None`` means: no regular file named :data:`MARKER` (a symlink of that name is not followed), or one that
    is not JSON or not marked ``"written_by": "depthfusion-hf"`` (a foreign file that has the name).

    Raises:
        MarkerError: a marker that claims to be this package's but lists an entry that is not a plain relative
            name inside the folder, or has malformed hashes, folder identity or format; the message names the
            marker and the entry.
    """
    path = folder / MARKER
    try:
        text = _read_no_follow(path)
    except (OSError, UnicodeDecodeError):  # none, a link, a pipe, or bytes that are no UTF-8: not this package's
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("written_by") != WRITER:
        return None
    version = data.get("format", 1)
    if version not in (1, FORMAT):
        raise MarkerError(f"{path} has marker format {version!r}, written by a newer depthfusion-hf than this one "
                          f"(format {FORMAT}); nothing was deleted or written. Upgrade the package.")
    files = data.get("files")
    if not isinstance(files, list):
        raise _problem(path, f"'files' must be a list of file names; got {type(files).__name__}")
    for entry in files:
        problem = entry_problem(entry)
        if problem is not None:
            raise _problem(path, f"entry {entry!r} {problem}")
    if len(set(files)) != len(files):
        raise _problem(path, "an entry is listed twice")
    if version == 1:
        return Marker(tuple(files), None, None)
    hashes = data.get("sha256")
    if not isinstance(hashes, dict) or set(hashes) != set(files):
        raise _problem(path, "'sha256' must map every listed file, and only those, to its content hash")
    sha256 = {}
    for name, value in hashes.items():
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, str) and _HASH.fullmatch(v) for v in values):
            raise _problem(path, f"the hash of entry {name!r} is not a SHA-256 hex digest: {value!r:.80}")
        sha256[name] = frozenset(values)
    identity = data.get("folder")
    if not (isinstance(identity, list) and len(identity) == 2 and all(type(i) is int for i in identity)):
        raise _problem(path, f"'folder' must be [device, inode]; got {identity!r:.80}")
    return Marker(tuple(files), sha256, (identity[0], identity[1]))


def folder_identity(folder: Path) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of ``folder`` itself (a symlink is not followed)."""
    info = os.lstat(folder)
    return info.st_dev, info.st_ino


def write_marker(folder: Path, sha256: dict[str, frozenset[str] | str], scratch: Path | None = None) -> None:
    """Write ``folder``'s marker atomically (through a temporary file in ``scratch`` or ``folder``).

    Args:
        folder: the folder the marker describes.
        sha256: every file the package wrote there -> its hash (or the set of hashes it may have).
        scratch: where to create the temporary file (same file system as ``folder``).
    """
    from . import __version__

    files = sorted(sha256)
    for name in files:
        problem = entry_problem(name)
        if problem is not None:  # the package never writes a marker it would refuse to read
            raise ValueError(f"the export would list {name!r}, which {problem}")
    hashes = {name: sorted(v) if isinstance(v, frozenset | set) else v for name, v in sorted(sha256.items())}
    hashes = {name: v[0] if isinstance(v, list) and len(v) == 1 else v for name, v in hashes.items()}
    data = {"written_by": WRITER, "version": __version__, "format": FORMAT, "folder": list(folder_identity(folder)),
            "files": files, "sha256": hashes}
    handle, temp = tempfile.mkstemp(prefix=".marker-", dir=scratch or folder)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(json.dumps(data, indent=1) + "\n")
        os.chmod(temp, 0o666 & ~_umask())
        os.replace(temp, folder / MARKER)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _open_parent(folder: Path, relative: str) -> tuple[int, str] | None:
    """An fd of the folder holding ``relative`` inside ``folder`` and the last component, every component opened
    with ``O_NOFOLLOW``; ``None`` when a component is missing, a symlink or not a folder."""
    parts = relative.split("/")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(folder, flags)
    except OSError:
        return None
    for part in parts[:-1]:
        try:
            child = os.open(part, flags, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = child
    return fd, parts[-1]


# O_NONBLOCK: opening a FIFO left where a file should be returns at once instead of waiting for a writer.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _read_no_follow(path: Path) -> str:
    fd = os.open(path, _READ_FLAGS)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return handle.read(16 << 20).decode("utf-8")


def file_sha256(folder: Path, relative: str) -> str | None:
    """The SHA-256 of the regular file ``relative`` inside ``folder``; ``None`` when it is missing, a symlink or
    lies behind one, is not a regular file, or cannot be read."""
    opened = _open_parent(folder, relative)
    if opened is None:
        return None
    parent, name = opened
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=parent)
    except OSError:
        return None
    finally:
        os.close(parent)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return None
        return hashlib.file_digest(handle, "sha256").hexdigest()


def remove_if_unchanged(folder: Path, relative: str, hashes: frozenset[str]) -> bool:
    """Delete ``relative`` inside ``folder`` when it is a regular file (reached without following a symlink)
    whose content has one of ``hashes``; True when it was deleted."""
    if file_sha256(folder, relative) not in hashes:
        return False
    opened = _open_parent(folder, relative)
    if opened is None:
        return False
    parent, name = opened
    try:
        os.unlink(name, dir_fd=parent)
    except FileNotFoundError:
        return False
    finally:
        os.close(parent)
    return True


__all__ = [
    "FORMAT",
    "MARKER",
    "ExportTargetError",
    "Marker",
    "MarkerError",
    "entry_problem",
    "file_sha256",
    "folder_identity",
    "load_marker",
    "remove_if_unchanged",
    "write_marker",
]
