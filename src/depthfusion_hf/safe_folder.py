"""Write a folder the package owns without deleting or replacing anything the package did not write.

Every folder written here (exports, the training script's final models) holds :data:`MARKER`, listing the files
the package wrote with their SHA-256 hashes (:mod:`depthfusion_hf.export_marker`). The rules are
:func:`write_folder`'s; docs/RELIABILITY.md §1 lists them with the cases that test them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .export_marker import (
    MARKER,
    ExportTargetError,
    Marker,
    MarkerError,
    file_sha256,
    folder_identity,
    load_marker,
    remove_if_unchanged,
    write_marker,
)

__all__ = ["MARKER", "ExportTargetError", "MarkerError", "ReplacedEditedFilesWarning", "TargetState", "check_target",
           "clean_stale_staging", "load_marker", "write_folder"]


class ReplacedEditedFilesWarning(UserWarning):
    """``overwrite=True`` replaced files an earlier export wrote and the user changed since (named in the message)."""


@dataclass(frozen=True)
class TargetState:
    """What is at an export's target (symlinks resolved): the listed files unchanged (``ours``) and changed
    (``edited``), the top-level entries the package did not write (``foreign``, folders with a trailing ``/``),
    whether it holds the working directory, and its marker."""

    path: Path
    exists: bool
    ours: frozenset[str] = frozenset()
    foreign: tuple[str, ...] = ()
    holds_cwd: bool = False
    edited: tuple[str, ...] = ()
    marker: Marker | None = None


def _listing(folder: Path, skip: str | None = None) -> list[str]:
    """Every non-folder entry under ``folder`` (links to folders included, not followed) but the top-level ``skip``."""
    return sorted(
        (Path(root) / name).relative_to(folder).as_posix()
        for root, dirs, names in os.walk(folder)
        for name in names + [d for d in dirs if (Path(root) / d).is_symlink()]
        if Path(root) != folder or name != skip
    )


def check_target(folder: str | os.PathLike, overwrite: bool = False, ignore: str | None = None) -> TargetState:
    """Describe the target ``folder`` (``ignore``: a top-level entry not to count), raising when an export may not
    write there; nothing is changed. Call it before long work (training).

    Raises:
        ExportTargetError: a file or another non-folder, or a dangling symlink; without ``overwrite``, a folder
            holding entries this package did not write, files it wrote that were changed since, or the current
            working directory. MarkerError: an untrusted marker (even with ``overwrite``).
    """
    given = Path(folder)
    if given.is_symlink() and not given.exists():
        raise ExportTargetError(f"export target {given} is a symlink to nothing ({os.readlink(given)})")
    path = given.resolve()
    if path.exists() and not path.is_dir():
        raise ExportTargetError(f"export target {path} is a file, not a folder; the export never replaces it "
                                "(choose another folder)")
    if not path.exists():
        return TargetState(path, False)
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the working directory was deleted: it is in no target
        cwd = path.parent
    marker = load_marker(path)
    listed = {MARKER, *marker.files} if marker is not None else set()
    names = [name for name in _listing(path) if not name.startswith(f"{ignore}/")]
    foreign = set()
    for entry in path.iterdir():
        inside = [name for name in names if name == entry.name or name.startswith(entry.name + "/")]
        if entry.name != ignore and (not inside or any(name not in listed for name in inside)):
            foreign.add(entry.name + ("/" if entry.is_dir() and not entry.is_symlink() else ""))
    present = [name for name in names if name in listed and name != MARKER]
    ours = frozenset(name for name in present if file_sha256(path, name) in marker.sha256[name])
    state = TargetState(path, True, ours, tuple(sorted(foreign)), cwd == path or path in cwd.parents,
                        tuple(name for name in present if name not in ours), marker)
    reasons = []
    if state.foreign:
        what = "holds entries this package did not write" if state.marker is not None else \
            f"is not an export of this package (no {MARKER}) and is not empty"
        reasons.append(f"{what}: {', '.join(state.foreign)}")
    if state.edited:
        reasons.append(f"holds files an earlier export wrote that were changed since (edited by you?): "
                       f"{', '.join(state.edited)}")
    if state.holds_cwd:
        reasons.append("is the current working directory (or contains it)")
    if reasons and not overwrite:
        raise ExportTargetError(
            f"export target {state.path} {'; and it '.join(reasons)}. Nothing was written. Choose another folder, "
            "move those entries away yourself, or pass overwrite=True (--overwrite): the export is written in place, "
            "entries this package did not write are kept, and changed files the export writes again are replaced "
            "(a warning names them).")
    return state


def clean_stale_staging(target: Path) -> list[Path]:
    """Delete the staging and backup folders of ``target`` that dead processes left (beside it, or inside it
    for a mount point); returns what was removed.

    Only ``.<name>.tmp-<pid>-*`` / ``.<name>.old-<pid>-*`` that are real folders of this user, whose process is
    gone and whose marker is this package's and was written in that very folder (device and inode) qualify. A
    staging folder is deleted whole; a backup loses only its listed, unchanged files. A look-alike (a copy, an
    archive, a hand-made folder) is left alone with a warning.
    """
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(tmp|old)-(\d+)-\w+")
    places = [place for place in (target.parent, target) if place.is_dir() and not place.is_symlink()]
    removed = []
    for entry in sorted(entry for place in places for entry in place.iterdir()):
        match = pattern.fullmatch(entry.name)
        info = os.lstat(entry)
        if match is None or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if not _process_gone(int(match.group(2))):
            continue
        try:
            marker = load_marker(entry)
            if marker is not None and marker.folder != folder_identity(entry):
                raise MarkerError("its marker was not written in this folder (a copy or a look-alike)")
        except MarkerError as error:
            warnings.warn(f"{entry} looks like a leftover of an export to {target} but was left alone: {error}. "
                          "Remove it yourself if it is not needed.", stacklevel=3)
            continue
        if marker is not None and match.group(1) == "tmp":
            shutil.rmtree(entry, ignore_errors=True)
        if marker is not None and (not os.path.lexists(entry) or _remove_listed(entry, marker)):
            removed.append(entry)
    return removed


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # another user's process, or no valid pid: kept
        pass
    return False


def _remove_listed(folder: Path, marker: Marker) -> bool:
    """Delete the listed, unchanged files, the marker and the emptied folders; True when ``folder`` is gone."""
    with contextlib.suppress(OSError):  # e.g. a read-only folder: what is left is kept and named below
        for relative in marker.files:
            remove_if_unchanged(folder, relative, marker.sha256[relative])
        (folder / MARKER).unlink(missing_ok=True)
    for root, _, _ in os.walk(folder, topdown=False):  # sub-folders before their parents
        with contextlib.suppress(OSError):  # not empty: the user's (or a changed) file is inside; kept
            os.rmdir(root)
    if os.path.lexists(folder):
        warnings.warn(f"{folder} still holds entries this package did not write (or changed since, or that could "
                      "not be removed); they were kept", stacklevel=3)
    return not os.path.lexists(folder)


def _new_staging(target: Path, pid: int | None = None, inside: bool = False) -> Path:
    """A staging folder ``.<name>.tmp-<pid>-*`` beside ``target`` (in it when ``inside``), marked from the start."""
    staging = (target if inside else target.parent) / f".{target.name}.tmp-{pid or os.getpid()}-{secrets.token_hex(6)}"
    staging.mkdir()  # the umask applies (mkdtemp would make it 0700)
    try:
        write_marker(staging, {})
    except BaseException:
        shutil.rmtree(staging)
        raise
    return staging


def write_folder(folder: str | os.PathLike, write: Callable[[Path], None], overwrite: bool = False,
                 check: Callable[[Path], list[str]] | None = None) -> Path:
    """Write a folder with ``write(staging)`` (regular files only), then put it at ``folder`` by this module's rules.

    Args:
        folder: the target.
        write: fills the staging folder it is given (empty but for the marker).
        overwrite: write into a folder holding entries the package did not write (kept), replacing files an
            earlier export wrote and the user changed (a :class:`ReplacedEditedFilesWarning` names them).
        check: returns the staged folder's problems; any problem refuses the export (``ValueError``).
    Returns:
        The target's resolved path.
    Raises:
        ExportTargetError: see :func:`check_target`; with ``overwrite`` also a foreign file with the name of a file
            the export writes, or a link or file where it needs a folder. MarkerError: an untrusted marker.
        ValueError: from ``check``, or the writer made a symlink.
        OSError: the disk filled up while the export was staged (the message says so and that the target was not
            changed), or another failure of the file system.
    """
    clean_stale_staging(Path(folder).resolve())
    target = check_target(folder, overwrite=overwrite).path
    inside = os.path.ismount(target)
    try:
        return _write(target, write, overwrite, check, inside)
    except OSError as error:
        if inside or error.errno not in (errno.EXDEV, errno.EBUSY):
            raise
        # a bind mount (a Docker volume on the same disk): no rename crosses it, whatever the device numbers say
        return _write(target, write, overwrite, check, inside=True)


def _write(target: Path, write: Callable[[Path], None], overwrite: bool, check: Callable[[Path], list[str]] | None,
           inside: bool) -> Path:
    """:func:`write_folder`'s work; ``inside``: stage in the target and update it in place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = None
    try:
        try:
            staging = _new_staging(target, inside=inside)
            write(staging)
            written = {relative: file_sha256(staging, relative) for relative in _listing(staging, skip=MARKER)}
            write_marker(staging, {name: digest for name, digest in written.items() if digest is not None})
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            raise OSError(error.errno, f"the disk is full ({os.strerror(error.errno)}) while the export to {target} "
                          f"was written; the partial export was removed and {target} was not changed. Free some "
                          "space and export again") from error
        links = [name for name, digest in written.items() if digest is None]
        if links:
            raise ValueError(f"the export wrote {', '.join(links)}, which is a symlink or not a regular file; an "
                             "export holds regular files only")
        problems = check(staging) if check is not None else []
        if problems:
            raise ValueError(f"the export of {target.name} is incomplete: " + "; ".join(problems))
        state = check_target(target, overwrite, ignore=staging.name)  # again: it may have changed meanwhile
        if inside or state.foreign or state.edited or state.holds_cwd:
            _update_in_place(staging, target, written, state)
        else:
            _swap_in(staging, target, state)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)  # gone already when it was renamed to the target
    return target


def _swap_in(staging: Path, target: Path, state: TargetState) -> None:
    """Rename ``staging`` to ``target``; an old export there is renamed aside first, then emptied of its files."""
    if not state.exists or not any(target.iterdir()):
        os.replace(staging, target)  # onto nothing or an empty folder (fails if someone fills it meanwhile)
        return
    backup = target.parent / f".{target.name}.old-{os.getpid()}-{secrets.token_hex(6)}"
    os.replace(target, backup)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(backup, target)
        raise
    _remove_listed(backup, state.marker)


def _update_in_place(staging: Path, target: Path, written: dict[str, str], state: TargetState) -> None:
    """Move the staged files into ``target`` one by one, keeping every foreign entry. While they move, the marker
    accepts the old and the new content of each file, so the next export finishes an interrupted update."""
    blocked = {MARKER} if os.path.lexists(target / MARKER) and state.marker is None else set()
    for relative in written:
        parts = relative.split("/")
        above = [target.joinpath(*parts[:depth]) for depth in range(1, len(parts))]
        in_the_way = [a for a in above if a.is_symlink() or (a.exists() and not a.is_dir())]
        if in_the_way:  # a link or a file where the export needs a folder
            blocked.add(in_the_way[0].relative_to(target).as_posix())
        elif relative not in state.ours and relative not in state.edited and os.path.lexists(target / relative):
            blocked.add(relative)
    if blocked:
        raise ExportTargetError(
            f"export target {target} holds entries this package did not write with the names of files the export "
            f"writes (or of folders on the way to them): {', '.join(sorted(blocked))}. Even with overwrite they are "
            "not replaced; move them away or choose another folder. Nothing was written.")
    old = state.marker.sha256 if state.marker is not None else {}
    write_marker(target, {name: old[name] for name in state.ours} | {
        name: frozenset({digest}) | old.get(name, frozenset()) for name, digest in written.items()}, scratch=staging)
    for relative in sorted(written):
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / relative, target / relative)
    for relative in sorted(state.ours - set(written)):  # the previous export's files this one does not write
        if remove_if_unchanged(target, relative, old[relative]):
            for parent in list(Path(relative).parents)[:-1]:  # and the folders that leaves empty
                with contextlib.suppress(OSError):
                    os.rmdir(target / parent)
    write_marker(target, written, scratch=staging)
    replaced = sorted(name for name in written if name in state.edited)
    if replaced:
        warnings.warn(f"overwrite=True replaced files in {target} that an earlier export wrote and that were "
                      f"changed since: {', '.join(replaced)}", ReplacedEditedFilesWarning, stacklevel=4)
