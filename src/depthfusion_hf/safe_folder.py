"""Write a folder the package owns without deleting or replacing anything the package did not write.

Every folder written here (model exports, the training script's final models) holds a marker file,
:data:`MARKER`, listing the files the package wrote. The rules for a target folder:

- missing, or an empty folder: the new folder is built in a hidden staging sibling and renamed into
  place (atomic: the target is either absent or complete);
- a previous export of this package (marker present) whose entries are all listed in its marker: the
  old folder is renamed aside, the new one renamed in, and then only the files the old marker lists
  are deleted (atomic: at every moment the target is the complete old or the complete new folder);
- anything else -- a folder holding entries the package did not write (a training run's
  ``checkpoint-*/``, notes, the current working directory), a target that is or contains the current
  working directory, a file, a dangling symlink -- raises :class:`ExportTargetError` naming the folder
  and the foreign entries.

``overwrite=True`` allows the last case for folders (never for a file): the export's files are moved
into the folder one by one and every foreign entry is **kept**; the call still refuses when a foreign
file has the name of a file the export writes (overwrite never replaces what the package did not
write). This in-place update is not atomic as a whole (each file's rename is): the new files are
complete and checked before the first one is moved, and the marker lists the old and new files while
the move runs, so an interrupted update leaves a folder the next export recognises and finishes.

A symlink target is followed: the rules apply to the folder it points to, which is replaced where it
lies (the link keeps pointing at it).

Staging folders are named ``.<target name>.tmp-<pid>-<random>`` and carry the marker from their first
moment. A process killed mid-export (SIGKILL) leaves one behind; the next export to the same target
deletes every such folder whose marker is present and whose process is gone (and nothing else: a
hidden folder without the marker, or one of a process still running, is left alone). Backups of a
replaced export (``.<target name>.old-<pid>-<random>``, left when a process dies between the two
renames) are cleaned the same way, deleting only the files their marker lists.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MARKER = ".depthfusion-export.json"
WRITER = "depthfusion-hf"


class ExportTargetError(FileExistsError):
    """The target of an export holds something the package did not write, so it is neither replaced nor touched."""


@dataclass(frozen=True)
class TargetState:
    """What is at an export's target path now.

    Attributes:
        path: the target with symlinks resolved.
        exists: whether anything is there.
        ours: the files a previous export of this package wrote (paths relative to ``path``).
        foreign: the entries the package did not write (relative paths, folders with a trailing ``/``).
        holds_cwd: the target is, or contains, the current working directory.
    """

    path: Path
    exists: bool
    ours: frozenset[str]
    foreign: tuple[str, ...]
    holds_cwd: bool


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def read_marker(folder: Path) -> dict | None:
    """The marker of ``folder`` when it is a regular file written by this package, else ``None``."""
    path = folder / MARKER
    if path.is_symlink() or not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("written_by") != WRITER or not isinstance(marker.get("files"), list):
        return None
    return marker


def _write_marker(folder: Path, files: list[str], scratch: Path | None = None) -> None:
    """Write the marker atomically (through a temporary file in ``scratch`` or ``folder``)."""
    from . import __version__

    text = json.dumps({"written_by": WRITER, "version": __version__, "files": sorted(files)}, indent=1) + "\n"
    handle, temp = tempfile.mkstemp(prefix=".marker-", dir=scratch or folder)
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        out.write(text)
    os.chmod(temp, 0o666 & ~_umask())
    os.replace(temp, folder / MARKER)


def _listing(folder: Path) -> list[str]:
    """Every non-directory entry under ``folder`` (symlinks not followed), relative, except the marker."""
    files = []
    for root, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if (Path(root) / d).is_symlink()]:
            relative = (Path(root) / name).relative_to(folder).as_posix()
            if relative != MARKER:
                files.append(relative)
    return sorted(files)


def _foreign_entries(folder: Path, ours: frozenset[str]) -> tuple[str, ...]:
    """The top-level entries of ``folder`` that hold anything not listed in ``ours`` (folders end with ``/``)."""
    foreign = set()
    for entry in folder.iterdir():
        if entry.name == MARKER and read_marker(folder) is not None:
            continue
        if entry.is_dir() and not entry.is_symlink():
            inside = [f"{entry.name}/{f}" for f in _listing(entry)]
            if not inside or any(f not in ours for f in inside):
                foreign.add(entry.name + "/")
        elif entry.name not in ours:
            foreign.add(entry.name)
    return tuple(sorted(foreign))


def _holds_cwd(path: Path) -> bool:
    try:
        cwd = Path.cwd().resolve()
    except OSError:
        return False
    return cwd == path or path in cwd.parents


def inspect_target(folder: str | os.PathLike) -> TargetState:
    """Describe the target ``folder`` (see :class:`TargetState`) without changing anything.

    Raises:
        ExportTargetError: if ``folder`` is a file or another non-folder, or a dangling symlink.
    """
    given = Path(folder)
    if given.is_symlink() and not given.exists():
        raise ExportTargetError(f"export target {given} is a symlink to nothing ({os.readlink(given)})")
    path = given.resolve()
    if path.exists() and not path.is_dir():
        raise ExportTargetError(f"export target {path} is a file, not a folder; the export never replaces it "
                                "(choose another folder)")
    if not path.exists():
        return TargetState(path, False, frozenset(), (), _holds_cwd(path))
    marker = read_marker(path)
    ours = frozenset(marker["files"]) if marker is not None else frozenset()
    return TargetState(path, True, ours, _foreign_entries(path, ours), _holds_cwd(path))


def check_target(folder: str | os.PathLike, overwrite: bool = False) -> TargetState:
    """:func:`inspect_target`, raising :class:`ExportTargetError` when an export may not write there.

    Call it before long work whose result goes to ``folder`` (training), to fail before the work.

    Raises:
        ExportTargetError: a file or dangling symlink; without ``overwrite``, a folder holding entries this
            package did not write, or one that is or contains the current working directory.
    """
    state = inspect_target(folder)
    if overwrite or not state.exists:
        return state
    if state.foreign:
        shown = ", ".join(state.foreign[:20]) + (f", ... ({len(state.foreign)} in all)" if len(state.foreign) > 20
                                                 else "")
        what = "holds entries this package did not write" if state.ours else "is not an export of this package " \
            f"(no {MARKER}) and is not empty"
        raise ExportTargetError(
            f"export target {state.path} {what}: {shown}. Nothing was written. Choose another folder, remove "
            "those entries yourself, or pass overwrite=True (--overwrite) to write the export beside them "
            "(they are kept)."
        )
    if state.holds_cwd:
        raise ExportTargetError(
            f"export target {state.path} is the current working directory (or contains it); nothing was written. "
            "Choose another folder or pass overwrite=True (--overwrite) to write the export into it in place."
        )
    return state


def clean_stale_staging(target: Path) -> list[Path]:
    """Delete the staging and backup folders of ``target`` left by dead processes; returns what was removed.

    Only hidden siblings named ``.<name>.tmp-<pid>-*`` / ``.<name>.old-<pid>-*`` that are real folders
    holding this package's marker, whose process ``pid`` is no longer running, are touched. A staging
    folder is deleted whole (the package made it with ``mkdtemp`` and is its only writer); a backup loses
    only the files its marker lists and is removed only when nothing else is left in it.
    """
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(tmp|old)-(\d+)-[A-Za-z0-9_]+")
    removed = []
    if not target.parent.is_dir():
        return removed
    for entry in target.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir() or _process_alive(int(match.group(2))):
            continue
        marker = read_marker(entry)
        if marker is None:
            continue
        if match.group(1) == "tmp":
            shutil.rmtree(entry)
            removed.append(entry)
        elif _remove_listed(entry, marker["files"]):
            removed.append(entry)
    return removed


def _remove_listed(folder: Path, files: list[str]) -> bool:
    """Delete the listed files and the marker, then the emptied folders; True when ``folder`` itself is gone."""
    for relative in files:
        path = folder / relative
        if path.is_symlink() or path.is_file():
            path.unlink()
    (folder / MARKER).unlink(missing_ok=True)
    for root, _, _ in sorted(os.walk(folder, topdown=False), key=lambda item: -len(item[0])):
        try:
            os.rmdir(root)
        except OSError:  # not empty: something the package did not write is inside; keep it
            pass
    if folder.exists():
        warnings.warn(f"{folder} still holds entries this package did not write; they were kept", stacklevel=3)
        return False
    return True


def write_folder(
    folder: str | os.PathLike,
    write: Callable[[Path], None],
    overwrite: bool = False,
    check: Callable[[Path], list[str]] | None = None,
) -> Path:
    """Write a folder with ``write(staging)``, then put it at ``folder`` by the rules of this module's docstring.

    Args:
        folder: the target.
        write: fills the (empty) staging folder it is given.
        overwrite: write into a folder that holds entries the package did not write (they are kept).
        check: returns the problems of the staged folder; any problem refuses the export with ``ValueError``
            and leaves the target untouched.
    Returns:
        The target's resolved path.
    Raises:
        ExportTargetError: see :func:`check_target`; also, with ``overwrite``, when a foreign file has the name
            of a file the export writes.
        ValueError: from ``check``.
    """
    state = check_target(folder, overwrite=overwrite)
    target = state.path
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        _write_marker(staging, [])  # from its first moment, the staging folder is recognisably ours
        write(staging)
        files = _listing(staging)
        _write_marker(staging, files)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes 0700; give the folder the usual permissions
        if check is not None:
            problems = check(staging)
            if problems:
                raise ValueError(f"the export of {target.name} is incomplete: " + "; ".join(problems))
        state = inspect_target(target)  # again: the target may have changed while the export was written
        if state.exists and (state.foreign or state.holds_cwd):
            if not overwrite:
                check_target(target)  # raises with the current foreign entries
            _update_in_place(staging, target, files, state)
        else:
            _swap_in(staging, target, state)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _swap_in(staging: Path, target: Path, state: TargetState) -> None:
    """Rename ``staging`` to ``target``; an old export there is renamed aside first and then removed file by file."""
    if not state.exists or not any(target.iterdir()):
        os.replace(staging, target)  # onto nothing or an empty folder (fails if someone fills it meanwhile)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{os.getpid()}-", dir=target.parent))
    os.rmdir(backup)  # a fresh unique name; the rename below creates it
    os.replace(target, backup)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(backup, target)
        raise
    _remove_listed(backup, sorted(state.ours))


def _update_in_place(staging: Path, target: Path, files: list[str], state: TargetState) -> None:
    """Move the staged files into ``target`` one by one, keeping every foreign entry (``overwrite=True``)."""
    clashes = sorted(f for f in files if (target / f).exists() or (target / f).is_symlink())
    clashes = [f for f in clashes if f not in state.ours]
    if (target / MARKER).exists() and read_marker(target) is None:  # a file of that name that is not our marker
        clashes.append(MARKER)
    if clashes:
        raise ExportTargetError(
            f"export target {target} holds files this package did not write with the names of files the export "
            f"writes: {', '.join(clashes)}. Even with overwrite they are not replaced; move them away or choose "
            "another folder. Nothing was written."
        )
    _write_marker(target, sorted(state.ours | set(files)), scratch=staging)  # an interruption stays accounted for
    for relative in files:
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / relative, destination)
    for relative in sorted(state.ours - set(files)):  # files of the previous export that this one does not write
        path = target / relative
        if path.is_symlink() or path.is_file():
            path.unlink()
    _write_marker(target, files, scratch=staging)
    shutil.rmtree(staging)


__all__ = [
    "MARKER",
    "ExportTargetError",
    "TargetState",
    "check_target",
    "clean_stale_staging",
    "inspect_target",
    "read_marker",
    "write_folder",
]
