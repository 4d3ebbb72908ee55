"""Write a folder the package owns without deleting or replacing anything the package did not write.

Every folder written here (model exports, the training script's final models) holds a marker file,
:data:`MARKER`, listing the files the package wrote with their SHA-256 content hashes (format and trust
rules: :mod:`depthfusion_hf.export_marker`). The rules for a target folder:

- missing, or an empty folder: the new folder is built in a hidden staging sibling and renamed into
  place (atomic: the target is either absent or complete);
- a previous export of this package (marker present) whose entries are all listed in its marker and
  unchanged (same content hash): the old folder is renamed aside, the new one renamed in, and then only
  the files the old marker lists, still unchanged, are deleted (atomic: at every moment the target is
  the complete old or the complete new folder);
- anything else -- a folder holding entries the package did not write (a training run's
  ``checkpoint-*/``, notes, the current working directory), a listed file the user changed since (an
  edited ``README.md`` model card, a hand-tuned ``config.json``), a target that is or contains the
  current working directory, a file, a dangling symlink -- raises :class:`ExportTargetError` naming the
  folder and those entries; a marker that lists a path outside the folder raises :class:`MarkerError`.

``overwrite=True`` allows the last case for folders (never for a file, never for an untrusted marker):
the export's files are moved into the folder one by one and every foreign entry is **kept**; a changed
file the export writes again is replaced, and the call warns (:class:`ReplacedEditedFilesWarning`) naming
every file it replaced; a changed file the export does not write again is kept (it is the user's now). The
call still refuses when a foreign file has the name of a file the export writes, or when a folder on the
way to one is a symlink or a file (overwrite never replaces what the package did not write). This
in-place update is not atomic as a whole (each file's rename is): the new files are complete and checked
before the first one is moved, and the marker accepts the old and the new content of each file while the
move runs, so an interrupted update leaves a folder the next export recognises and finishes.

A marker written before content hashes were recorded (format 1) cannot tell an edited file from the
package's own: every file it lists counts as changed, so the first export over such a folder needs
``overwrite=True`` (and names the files it replaces).

A symlink target is followed: the rules apply to the folder it points to, which is replaced where it
lies (the link keeps pointing at it). Inside a target nothing is followed: a listed path that now lies
behind a symlink is not the package's, and no file outside the folder is read, written or deleted.

Staging folders are named ``.<target name>.tmp-<pid>-<random>`` and carry the marker from their first
moment. A process killed mid-export (SIGKILL) leaves one behind; the next export to the same target
deletes it when it is a real folder (not a symlink) of this user, its process is gone, and its marker
is this package's and was written in that very folder (device and inode recorded in the marker: a copied,
extracted or hand-made look-alike is left alone, with a warning). Backups of a replaced export
(``.<target name>.old-<pid>-<random>``, left when a process dies between the two renames) pass the same
checks and then lose only the files their marker lists whose content is unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .export_marker import (
    MARKER,
    WRITER,
    ExportTargetError,
    Marker,
    MarkerError,
    file_sha256,
    folder_identity,
    load_marker,
    remove_if_unchanged,
    write_marker,
)

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class ReplacedEditedFilesWarning(UserWarning):
    """``overwrite=True`` replaced files an earlier export wrote and the user changed since (named in the message)."""


@dataclass(frozen=True)
class TargetState:
    """What is at an export's target path now.

    Attributes:
        path: the target with symlinks resolved.
        exists: whether anything is there.
        ours: the files a previous export of this package wrote and nobody changed since (paths relative to
            ``path``; the content hash matches the marker's).
        foreign: the entries the package did not write (relative paths, folders with a trailing ``/``).
        holds_cwd: the target is, or contains, the current working directory.
        edited: files the previous export wrote that were changed since (or, under a format-1 marker without
            hashes, that may have been).
        marker: the previous export's marker (``None`` when there is none).
    """

    path: Path
    exists: bool
    ours: frozenset[str]
    foreign: tuple[str, ...]
    holds_cwd: bool
    edited: tuple[str, ...] = ()
    marker: Marker | None = None


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's process, or no valid pid: keep
        return True
    return True


def read_marker(folder: str | os.PathLike) -> dict | None:
    """The marker of ``folder`` (``files``, ``sha256``, ``format``) when it is this package's, else ``None``.

    Raises:
        MarkerError: a marker of this package that cannot be trusted (see
            :func:`~depthfusion_hf.export_marker.load_marker`).
    """
    marker = load_marker(Path(folder))
    if marker is None:
        return None
    hashes = None if marker.sha256 is None else {name: sorted(v) for name, v in marker.sha256.items()}
    return {"written_by": WRITER, "format": 1 if marker.legacy else 2, "files": list(marker.files), "sha256": hashes}


def _listing(folder: Path) -> list[str]:
    """Every non-directory entry under ``folder`` (symlinks not followed), relative, except the top-level marker."""
    files = []
    for root, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if (Path(root) / d).is_symlink()]:
            relative = (Path(root) / name).relative_to(folder).as_posix()
            if relative != MARKER:
                files.append(relative)
    return sorted(files)


def _foreign_entries(folder: Path, listed: frozenset[str], marker_is_ours: bool) -> tuple[str, ...]:
    """The top-level entries of ``folder`` that hold anything not in ``listed`` (folders end with ``/``)."""
    foreign = set()
    for entry in folder.iterdir():
        if entry.name == MARKER and marker_is_ours:
            continue
        if entry.is_dir() and not entry.is_symlink():
            inside = [f"{entry.name}/{f}" for f in _listing(entry)]
            if not inside or any(f not in listed for f in inside):
                foreign.add(entry.name + "/")
        elif entry.name not in listed:
            foreign.add(entry.name)
    return tuple(sorted(foreign))


def _holds_cwd(path: Path) -> bool:
    try:
        cwd = Path.cwd().resolve()
    except OSError:
        return False
    return cwd == path or path in cwd.parents


def inspect_target(folder: str | os.PathLike, ignore: str | None = None) -> TargetState:
    """Describe the target ``folder`` (see :class:`TargetState`) without changing anything.

    Every file its marker lists is hashed (read without following symlinks) to tell the package's own files
    from changed ones.

    Raises:
        ExportTargetError: if ``folder`` is a file or another non-folder, or a dangling symlink.
        MarkerError: its marker claims to be this package's but lists a path outside the folder (or is
            malformed); the message names the marker and the entry.
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
    marker = load_marker(path)
    listed = frozenset(marker.files) if marker is not None else frozenset()
    present = [name for name in _listing(path) if name in listed]
    if marker is not None and marker.sha256 is not None:
        ours = frozenset(name for name in present if file_sha256(path, name) in marker.sha256[name])
    else:
        ours = frozenset()
    edited = tuple(name for name in present if name not in ours)
    foreign = tuple(entry for entry in _foreign_entries(path, listed, marker is not None) if entry != f"{ignore}/")
    return TargetState(path, True, ours, foreign, _holds_cwd(path), edited, marker)


def _shown(names: tuple[str, ...] | list[str]) -> str:
    return ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")


def check_target(folder: str | os.PathLike, overwrite: bool = False) -> TargetState:
    """:func:`inspect_target`, raising :class:`ExportTargetError` when an export may not write there.

    Call it before long work whose result goes to ``folder`` (training), to fail before the work.

    Raises:
        ExportTargetError: a file or dangling symlink; without ``overwrite``, a folder holding entries this
            package did not write or files it wrote that were changed since, or one that is or contains the
            current working directory.
        MarkerError: an untrusted marker (even with ``overwrite``).
    """
    state = inspect_target(folder)
    if not overwrite:
        _refuse_unless_free(state)
    return state


def _refuse_unless_free(state: TargetState) -> None:
    """Raise :class:`ExportTargetError` when an export without ``overwrite`` may not write to ``state``'s target."""
    if not state.exists:
        return
    reasons = []
    if state.foreign:
        what = "holds entries this package did not write" if state.marker is not None else \
            f"is not an export of this package (no {MARKER}) and is not empty"
        reasons.append(f"{what}: {_shown(state.foreign)}")
    if state.edited:
        if state.marker is not None and state.marker.legacy:
            reasons.append(f"holds files an earlier version of this package wrote without recording their content "
                           f"(so they may have been edited since): {_shown(state.edited)}")
        else:
            reasons.append(f"holds files an earlier export wrote that were changed since (edited by you?): "
                           f"{_shown(state.edited)}")
    if reasons:
        raise ExportTargetError(
            f"export target {state.path} {'; and it '.join(reasons)}. Nothing was written. Choose another folder, "
            "move those entries away yourself, or pass overwrite=True (--overwrite): entries this package did not "
            "write are kept, and changed files the export writes again are replaced (a warning names them)."
        )
    if state.holds_cwd:
        raise ExportTargetError(
            f"export target {state.path} is the current working directory (or contains it); nothing was written. "
            "Choose another folder or pass overwrite=True (--overwrite) to write the export into it in place."
        )


def _stale_sibling_problem(entry: Path, marker: Marker) -> str | None:
    if marker.legacy:
        return "its marker is of an older version of the package (no folder identity)"
    if marker.folder != folder_identity(entry):
        return "its marker was not written in this folder (a copy or a look-alike)"
    return None


def clean_stale_staging(target: Path) -> list[Path]:
    """Delete the staging and backup folders of ``target`` left by dead processes; returns what was removed.

    Only hidden siblings named ``.<name>.tmp-<pid>-*`` / ``.<name>.old-<pid>-*`` are considered, and only those
    that are real folders (not symlinks) owned by this user, whose process ``pid`` is gone, and whose marker is
    this package's and was written in that folder (its recorded device and inode match). A staging folder is
    deleted whole (the package made it with ``mkdtemp`` and is its only writer); a backup loses only the files
    its marker lists whose content is unchanged, and is removed only when nothing else is left in it. A
    look-alike (a copy, an extracted archive, a hand-made folder, an untrusted marker) is left alone with a
    warning.
    """
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(tmp|old)-(\d+)-[A-Za-z0-9_]+")
    removed: list[Path] = []
    places = [place for place in (target.parent, target) if place.is_dir() and not place.is_symlink()]
    for entry in sorted(entry for place in places for entry in place.iterdir()):
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        try:
            info = os.lstat(entry)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or _process_alive(int(match.group(2))):
            continue
        try:
            marker = load_marker(entry)
            problem = None if marker is None else _stale_sibling_problem(entry, marker)
        except MarkerError as error:
            marker, problem = None, str(error)
        if problem is not None:
            warnings.warn(f"{entry} looks like a leftover of an export to {target} but was left alone: {problem}. "
                          "Remove it yourself if it is not needed.", stacklevel=3)
        if marker is None or problem is not None:
            continue
        if match.group(1) == "tmp":
            try:
                shutil.rmtree(entry)
            except OSError as error:
                warnings.warn(f"could not remove the stale staging folder {entry}: {error}", stacklevel=3)
                continue
            removed.append(entry)
        elif _remove_listed(entry, marker):
            removed.append(entry)
    return removed


def _remove_listed(folder: Path, marker: Marker) -> bool:
    """Delete the listed files whose content is unchanged, the marker, then the emptied folders; True when
    ``folder`` itself is gone."""
    hashes = marker.sha256 or {}  # a format-1 marker proves nothing about a file's content: none is deleted
    try:
        for relative in marker.files:
            if relative in hashes:
                remove_if_unchanged(folder, relative, hashes[relative])
        (folder / MARKER).unlink(missing_ok=True)
    except OSError:  # e.g. a read-only folder: what is left is kept and named below; the new export stands
        pass
    for root, _, _ in sorted(os.walk(folder, topdown=False), key=lambda item: -len(item[0])):
        try:
            os.rmdir(root)
        except OSError:  # not empty: something the package did not write (or a changed file) is inside; keep it
            pass
    if os.path.lexists(folder):
        warnings.warn(f"{folder} still holds entries this package did not write (or changed since, or that could "
                      "not be removed); they were kept", stacklevel=3)
        return False
    return True


def _new_staging(target: Path, pid: int | None = None, inside: bool = False) -> Path:
    """A fresh staging folder ``.<target name>.tmp-<pid>-<random>`` beside ``target`` (in it when ``inside``),
    marked from its first moment."""
    pid = os.getpid() if pid is None else pid
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{pid}-", dir=target if inside else target.parent))
    try:
        write_marker(staging, {})
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def _staged_files(staging: Path) -> dict[str, str]:
    """Every file the writer put in ``staging`` -> its SHA-256 (the marker excluded).

    Raises:
        ValueError: the writer made a symlink or something else that is not a regular file.
    """
    hashes = {}
    for relative in _listing(staging):
        digest = file_sha256(staging, relative)
        if digest is None:
            raise ValueError(f"the export wrote {relative}, which is a symlink or not a regular file; an export "
                             "holds regular files only")
        hashes[relative] = digest
    return hashes


def write_folder(
    folder: str | os.PathLike,
    write: Callable[[Path], None],
    overwrite: bool = False,
    check: Callable[[Path], list[str]] | None = None,
) -> Path:
    """Write a folder with ``write(staging)``, then put it at ``folder`` by the rules of this module's docstring.

    Args:
        folder: the target.
        write: fills the (empty but for the marker) staging folder it is given, with regular files only.
        overwrite: write into a folder that holds entries the package did not write (they are kept), replacing
            files an earlier export wrote that were changed since (a :class:`ReplacedEditedFilesWarning` names
            them).
        check: returns the problems of the staged folder; any problem refuses the export with ``ValueError``
            and leaves the target untouched.
    Returns:
        The target's resolved path.
    Raises:
        ExportTargetError: see :func:`check_target`; also, with ``overwrite``, when a foreign file has the name
            of a file the export writes, or a folder on the way to one is a symlink or a file.
        MarkerError: the target's marker lists a path outside the folder, or is malformed (even with
            ``overwrite``); nothing is written.
        ValueError: from ``check``, or the writer made a symlink.
        OSError: the disk filled up (``ENOSPC`` / ``EDQUOT`` / ``EFBIG``) while the export was staged: the message
            says so and that the target was not changed.
    """
    clean_stale_staging(Path(folder).resolve())
    state = check_target(folder, overwrite=overwrite)
    target = state.path
    inside = state.exists and os.path.ismount(target)
    try:
        return _write(target, write, overwrite, check, inside)
    except OSError as error:
        if inside or error.errno not in (errno.EXDEV, errno.EBUSY):
            raise
        # a bind mount (a Docker volume on the same disk): no rename crosses it, whatever the device numbers say
        return _write(target, write, overwrite, check, inside=True)


def _write(target: Path, write: Callable[[Path], None], overwrite: bool, check: Callable[[Path], list[str]] | None,
           inside: bool) -> Path:
    """:func:`write_folder`'s work; ``inside``: stage in the target and update it in place (a mount point cannot
    be renamed, and no file can be renamed onto it from outside)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging: Path | None = None
    staged = False
    try:
        staging = _new_staging(target, inside=inside)
        write(staging)
        written = _staged_files(staging)
        write_marker(staging, written)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes 0700; give the folder the usual permissions
        if check is not None:
            problems = check(staging)
            if problems:
                raise ValueError(f"the export of {target.name} is incomplete: " + "; ".join(problems))
        staged = True
        # again: the target may have changed while the export was written
        state = inspect_target(target, ignore=staging.name if inside else None)
        if inside or (state.exists and (state.foreign or state.edited or state.holds_cwd)):
            if not overwrite:
                _refuse_unless_free(state)  # the current foreign or changed entries
            replaced = _update_in_place(staging, target, written, state)
            if replaced:
                warnings.warn(f"overwrite=True replaced files in {target} that an earlier export wrote and that were "
                              f"changed since: {', '.join(replaced)}", ReplacedEditedFilesWarning, stacklevel=3)
        else:
            _swap_in(staging, target, state)
    except OSError as error:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if error.errno in _DISK_FULL and not staged:
            raise OSError(error.errno, f"the disk is full ({os.strerror(error.errno)}) while the export to {target} "
                          f"was written; the partial export was removed and {target} was not changed. Free some "
                          "space and export again") from error
        raise
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
    _remove_listed(backup, state.marker)


def _blocked_paths(target: Path, written: dict[str, str], state: TargetState) -> list[str]:
    """The paths an in-place update may not write: a foreign entry with an export file's name, a symlink or a file
    where the export needs a folder, a foreign file named like the marker."""
    blocked = set()
    for relative in written:
        parts = relative.split("/")
        for depth in range(1, len(parts)):
            above = target.joinpath(*parts[:depth])
            if above.is_symlink() or (above.exists() and not above.is_dir()):
                blocked.add("/".join(parts[:depth]))
                break
        else:
            path = target / relative
            if relative not in state.ours and relative not in state.edited and os.path.lexists(path):
                blocked.add(relative)
    if os.path.lexists(target / MARKER) and state.marker is None:  # a file of that name that is not our marker
        blocked.add(MARKER)
    return sorted(blocked)


def _update_in_place(staging: Path, target: Path, written: dict[str, str], state: TargetState) -> list[str]:
    """Move the staged files into ``target`` one by one, keeping every foreign entry (``overwrite=True``); returns
    the changed files of the previous export that were replaced."""
    blocked = _blocked_paths(target, written, state)
    if blocked:
        raise ExportTargetError(
            f"export target {target} holds entries this package did not write with the names of files the export "
            f"writes (or of folders on the way to them): {', '.join(blocked)}. Even with overwrite they are not "
            "replaced; move them away or choose another folder. Nothing was written."
        )
    old = state.marker.sha256 if state.marker is not None and state.marker.sha256 is not None else {}
    progress = {name: old[name] for name in state.ours}  # while the files move, either content is the package's
    for name, digest in written.items():
        progress[name] = frozenset({digest}) | (old[name] if name in state.ours else frozenset())
    write_marker(target, progress, scratch=staging)
    for relative in sorted(written):
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / relative, destination)
    for relative in sorted(state.ours - set(written)):  # files of the previous export that this one does not write
        if remove_if_unchanged(target, relative, old[relative]):
            for parent in list(Path(relative).parents)[:-1]:  # the folders it leaves empty
                with contextlib.suppress(OSError):
                    os.rmdir(target / parent)
    write_marker(target, written, scratch=staging)
    shutil.rmtree(staging)
    return sorted(name for name in written if name in state.edited)


__all__ = [
    "MARKER",
    "ExportTargetError",
    "MarkerError",
    "ReplacedEditedFilesWarning",
    "TargetState",
    "check_target",
    "clean_stale_staging",
    "inspect_target",
    "read_marker",
    "write_folder",
]
