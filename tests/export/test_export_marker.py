"""The export marker is untrusted input, and a file the user edited is the user's (issue 19 §1).

A marker (or a stale ``.<name>.tmp-*`` / ``.<name>.old-*`` sibling) from a copied, corrupted or malicious
folder never makes an export delete, write or follow anything outside its target; a file an earlier
export wrote and the user then changed is never replaced without ``overwrite=True``, which names it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from depthfusion_hf.safe_folder import (
    MARKER,
    ExportTargetError,
    MarkerError,
    clean_stale_staging,
    load_marker,
    write_folder,
)

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _writer(files: dict[str, str]):
    def write(staging: Path) -> None:
        for name, text in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_text(text)

    return write


def _snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (symlinks not followed): files by content hash, links by their target."""
    out = {}
    for folder, dirs, names in os.walk(root):
        for name in names + dirs:
            path = Path(folder) / name
            key = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[key] = "-> " + os.readlink(path)
            elif path.is_file():
                out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif path.is_dir():
                out[key] = "dir"
    return out


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _forge_marker(folder: Path, files: list, hashes: dict | None = None) -> None:
    """A marker written by hand (as a tarball, a shared drive or an attacker could)."""
    data = {"written_by": "depthfusion-hf", "format": 2, "files": files}
    if hashes is not None:
        data.update(sha256=hashes, folder=[0, 0])
    (folder / MARKER).write_text(json.dumps(data))


# -- untrusted marker entries ---------------------------------------------------------------------------------

_NAME = st.text(alphabet="abcz_-.", min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))


@st.composite
def _escaping_entries(draw) -> str:
    """Marker entries that would reach ``<tmp>/victim.txt`` (the target is ``<tmp>/out``) if they were followed."""
    kind = draw(st.sampled_from(["dotdot", "inner-dotdot", "absolute", "dot", "double-slash", "backslash",
                                 "trailing-slash", "control"]))
    inner = draw(st.lists(_NAME, max_size=3))
    if kind == "dotdot":
        return "../" * draw(st.integers(1, 3)) + "victim.txt"
    if kind == "inner-dotdot":
        return "/".join(inner + [".."] * (len(inner) + 1) + ["victim.txt"])
    if kind == "absolute":
        return "//VICTIM" if draw(st.booleans()) else "/VICTIM"  # replaced by the victim's absolute path
    if kind == "dot":
        return "/".join(["."] + inner + ["..", "victim.txt"]) if inner else "./../victim.txt"
    if kind == "double-slash":
        return "..//victim.txt"
    if kind == "backslash":
        return "..\\victim.txt"
    if kind == "trailing-slash":
        return "../victim.txt/"
    return "../victim.txt\n"


def _victim_setup(root: Path, entry: str) -> tuple[Path, Path, str]:
    root.mkdir()
    victim = root / "victim.txt"
    victim.write_text("the user's file, outside the export")
    if entry in ("/VICTIM", "//VICTIM"):
        entry = entry.replace("/VICTIM", str(victim))
    target = root / "out"
    target.mkdir()
    (target / "a.txt").write_text("old")
    return target, victim, entry


@PROPERTY
@given(entry=_escaping_entries(), hashed=st.booleans(), overwrite=st.booleans())
def test_a_marker_listing_a_path_outside_the_folder_is_refused_and_nothing_changes(tmp_path_factory, entry, hashed,
                                                                                   overwrite):
    root = tmp_path_factory.mktemp("escape") / "case"
    target, victim, entry = _victim_setup(root, entry)
    _forge_marker(target, ["a.txt", entry], {"a.txt": _sha("old"), entry: _sha(victim.read_text())} if hashed else None)
    before = _snapshot(root)
    with pytest.raises(ExportTargetError) as error:
        write_folder(target, _writer({"a.txt": "new"}), overwrite=overwrite)
    message = str(error.value)
    assert str(target / MARKER) in message and repr(entry) in message, message
    assert _snapshot(root) == before  # the victim, the folder and its siblings: nothing deleted or written


@pytest.mark.parametrize("files", [["a.txt", "a.txt"], [1], "a.txt", {"a.txt": 1}, [None], [""], [MARKER],
                                   ["sub/" + MARKER]], ids=repr)
def test_a_malformed_marker_of_this_package_is_refused_naming_it(tmp_path, files):
    target = tmp_path / "out"
    target.mkdir()
    (target / "a.txt").write_text("old")
    (target / MARKER).write_text(json.dumps({"written_by": "depthfusion-hf", "format": 2, "files": files}))
    before = _snapshot(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(ExportTargetError, match=MARKER):
            write_folder(target, _writer({"a.txt": "new"}), overwrite=overwrite)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("data", [b'{"written_by": "depthfusion-hf\xe9"}', b"\xff\xfe{}", b"", b"{"], ids=repr)
def test_a_file_named_like_the_marker_that_is_no_json_is_a_foreign_file(tmp_path, data):
    target = tmp_path / "out"
    target.mkdir()
    (target / "a.txt").write_text("old")
    (target / MARKER).write_bytes(data)
    before = _snapshot(tmp_path)
    with pytest.raises(ExportTargetError, match=rf"not an export of this package .*{MARKER}"):
        write_folder(target, _writer({"a.txt": "new"}))
    with pytest.raises(ExportTargetError, match=rf"names of files the export writes.*{MARKER}"):
        write_folder(target, _writer({"b.txt": "new"}), overwrite=True)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_listed_file_behind_a_symlinked_folder_is_never_deleted_or_written(tmp_path, overwrite):
    """``sub`` was replaced by a link to a folder outside: neither the old file there nor the new one is touched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a.txt").write_text("kept")
    target = write_folder(tmp_path / "out", _writer({"sub/a.txt": "kept", "b.txt": "1"}))
    shutil.rmtree(target / "sub")
    (target / "sub").symlink_to(outside)
    before = _snapshot(tmp_path)
    with pytest.raises(ExportTargetError, match="sub"):  # a foreign entry; with overwrite: a symlink on the way
        write_folder(target, _writer({"sub/a.txt": "new", "b.txt": "2"}), overwrite=overwrite)
    assert _snapshot(tmp_path) == before
    if overwrite:  # an export that does not write under sub/: the old listed file behind the link stays
        write_folder(target, _writer({"b.txt": "2"}), overwrite=True)
        assert (outside / "a.txt").read_text() == "kept" and (target / "sub").is_symlink()
        assert (target / "b.txt").read_text() == "2"


def test_a_listed_file_replaced_by_a_symlink_is_the_users(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not the package's")
    target = write_folder(tmp_path / "out", _writer({"config.json": "{}"}))
    (target / "config.json").unlink()
    (target / "config.json").symlink_to(secret)
    with pytest.raises(ExportTargetError, match="config.json"):
        write_folder(target, _writer({"config.json": "{}"}))
    with pytest.warns(UserWarning, match="config.json"):
        write_folder(target, _writer({"config.json": "{}"}), overwrite=True)
    assert secret.read_text() == "not the package's" and not (target / "config.json").is_symlink()


# -- files the user edited ------------------------------------------------------------------------------------

FILES = {"README.md": "card", "config.json": '{"a": 1}', "model.safetensors": "weights", "sub/vocab.txt": "v"}
EDITS = {
    "content": lambda path: path.write_text(path.read_text() + " edited"),
    "truncated": lambda path: path.write_text(""),
    "same-size": lambda path: path.write_text(path.read_text().swapcase()),
}


@PROPERTY
@given(edited=st.sets(st.sampled_from(sorted(FILES)), min_size=1), kind=st.sampled_from(sorted(EDITS)),
       rewritten=st.sets(st.sampled_from(sorted(FILES))))
def test_an_edited_file_is_refused_by_name_and_overwrite_replaces_only_what_it_names(tmp_path_factory, edited, kind,
                                                                                   rewritten):
    root = tmp_path_factory.mktemp("edited")
    target = write_folder(root / "out", _writer(FILES))
    for name in edited:
        EDITS[kind](target / name)
    before = _snapshot(root)
    with pytest.raises(ExportTargetError) as error:
        write_folder(target, _writer({name: "new " + name for name in rewritten}))
    assert "changed since" in str(error.value) and all(name in str(error.value) for name in edited)
    assert _snapshot(root) == before
    edits = {name: (target / name).read_text() for name in edited}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_folder(target, _writer({name: "new " + name for name in rewritten}), overwrite=True)
    replaced = sorted(edited & rewritten)
    messages = [str(w.message) for w in caught if "replaced" in str(w.message)]
    assert (messages != []) == bool(replaced) and all(", ".join(replaced) in m for m in messages)
    for name in FILES:
        path = target / name
        if name in rewritten:
            assert path.read_text() == "new " + name
        elif name in edited:
            assert path.read_text() == edits[name]  # the user's version, not written again: kept
        else:
            assert not path.exists()  # the package's own old file, not written again: removed
    assert list(load_marker(target).files) == sorted(rewritten)


@pytest.mark.parametrize("where", ["README.md", MARKER])
def test_a_pipe_where_a_file_is_expected_never_blocks_the_export(tmp_path, where):
    """Opening a FIFO for reading waits for a writer: the export must look at it without opening it blocking."""
    target = write_folder(tmp_path / "out", _writer({"README.md": "card"}))
    (target / where).unlink()
    os.mkfifo(target / where)

    def hung(*_):
        raise TimeoutError("the export blocked on a FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        with pytest.raises(ExportTargetError, match="README.md" if where == "README.md" else MARKER):
            write_folder(target, _writer({"README.md": "new"}), overwrite=where == MARKER)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert stat.S_ISFIFO(os.lstat(target / where).st_mode)


def test_the_edited_model_card_survives_the_next_export(tmp_path):
    target = write_folder(tmp_path / "out", _writer({"README.md": "generated", "config.json": "{}"}))
    (target / "README.md").write_text("my model card")
    with pytest.raises(ExportTargetError, match=r"changed since \(edited by you\?\): README.md"):
        write_folder(target, _writer({"README.md": "generated again", "config.json": "{}"}))
    assert (target / "README.md").read_text() == "my model card"


@pytest.mark.parametrize("version", [None, 1, 3, "2"], ids=repr)
def test_a_marker_of_another_format_is_refused_naming_it(tmp_path, version):
    """Only format 2 is read: a marker without hashes (no format, or 1) cannot tell an edited file from the
    package's, and a newer one may mean something else; the folder is refused, also with overwrite, and nothing
    changes."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "README.md").write_text("maybe edited")
    (target / "config.json").write_text("{}")
    data = {"written_by": "depthfusion-hf", "version": "0.1.0", "files": ["README.md", "config.json"]}
    (target / MARKER).write_text(json.dumps(data if version is None else data | {"format": version}))
    before = _snapshot(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(MarkerError, match=rf"{MARKER} is not a valid export marker: its format is {version!r}, "
                                              r"and this depthfusion-hf reads format 2 only"):
            write_folder(target, _writer({"README.md": "new", "config.json": "{}"}), overwrite=overwrite)
        assert _snapshot(tmp_path) == before
    with pytest.raises(MarkerError, match="format"):
        load_marker(target)


def test_an_interrupted_overwrite_update_is_finished_without_spurious_edits(tmp_path, monkeypatch):
    """Killed between two moves: each file holds the old or the new content, both the package's."""
    target = tmp_path / "run"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    write_folder(target, _writer({"a.txt": "1", "b.txt": "1"}), overwrite=True)
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst) == target / "b.txt":  # a.txt is moved, then the process is interrupted
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(KeyboardInterrupt):
        write_folder(target, _writer({"a.txt": "2", "b.txt": "2"}), overwrite=True)
    monkeypatch.setattr(os, "replace", real_replace)
    assert (target / "a.txt").read_text() == "2" and (target / "b.txt").read_text() == "1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing counts as edited: no warning
        write_folder(target, _writer({"a.txt": "3", "b.txt": "3"}), overwrite=True)
    assert (target / "notes.txt").read_text() == "mine" and (target / "b.txt").read_text() == "3"


# -- stale siblings -------------------------------------------------------------------------------------------


def _real_stale_staging(target: Path, pid: int) -> Path:
    """A staging folder exactly as a process ``pid`` killed mid-export leaves it."""
    from depthfusion_hf.safe_folder import _new_staging

    staging = _new_staging(target, pid=pid)
    (staging / "model.safetensors").write_bytes(b"half")
    return staging


def test_a_real_stale_staging_folder_is_cleaned_and_a_copy_of_it_is_not(tmp_path):
    target = write_folder(tmp_path / "out", _writer({"a.txt": "1"}))
    dead = _dead_pid()
    stale = _real_stale_staging(target, dead)
    copy = tmp_path / f".out.tmp-{dead}-copied1"
    shutil.copytree(stale, copy)  # as a tarball or a shared drive would bring it: same marker, another folder
    with pytest.warns(UserWarning, match="not written in this folder"):
        assert clean_stale_staging(target) == [stale]
    assert not stale.exists() and (copy / "model.safetensors").read_bytes() == b"half"


@pytest.mark.parametrize("kind", ["tmp", "old"])
@pytest.mark.parametrize("forgery", ["legacy", "wrong-identity", "escaping", "symlink"])
def test_a_forged_sibling_is_left_alone_and_never_followed(tmp_path, kind, forgery):
    target = write_folder(tmp_path / "out", _writer({"a.txt": "1"}))
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "a.txt").write_text("the user's too")
    sibling = tmp_path / f".out.{kind}-{_dead_pid()}-forged01"
    if forgery == "symlink":
        _forge_marker(elsewhere, ["a.txt"])
        sibling.symlink_to(elsewhere)
    else:
        sibling.mkdir()
        (sibling / "user.txt").write_text("not the package's")
        (sibling / "a.txt").write_text("the user's copy")
        entry = "../victim.txt" if forgery == "escaping" else "a.txt"
        _forge_marker(sibling, ["user.txt", entry], None if forgery == "legacy" else
                      {"user.txt": _sha("not the package's"), entry: _sha(victim.read_text() if forgery == "escaping"
                                                                          else "the user's copy")})
    before = _snapshot(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_folder(target, _writer({"a.txt": "2"}))
        assert clean_stale_staging(target) == []
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("out/")} == \
        {k: v for k, v in before.items() if not k.startswith("out/")}
    assert (target / "a.txt").read_text() == "2"


def test_a_stale_backup_keeps_the_files_changed_since(tmp_path):
    target = write_folder(tmp_path / "out", _writer({"a.txt": "1", "README.md": "card"}))
    dead = _dead_pid()
    backup = tmp_path / f".out.old-{dead}-backup01"
    os.replace(target, backup)  # as a process killed between the two renames leaves it
    (backup / "README.md").write_text("edited in the backup")
    with pytest.warns(UserWarning, match="still holds entries"):
        write_folder(tmp_path / "out", _writer({"a.txt": "2"}))
    assert (backup / "README.md").read_text() == "edited in the backup" and not (backup / "a.txt").exists()


@pytest.mark.parametrize("pid", ["99999999999999999999", "0"])
def test_a_sibling_with_an_impossible_pid_is_left_alone_without_a_crash(tmp_path, pid):
    target = write_folder(tmp_path / "out", _writer({"a.txt": "1"}))
    sibling = tmp_path / f".out.tmp-{pid}-abcdef12"
    sibling.mkdir()
    _forge_marker(sibling, [])
    write_folder(target, _writer({"a.txt": "2"}))
    assert sibling.is_dir() and (target / "a.txt").read_text() == "2"


# -- failures while writing: a half-written export never replaces a good one ----------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_full_disk_is_reported_as_such_and_the_old_export_stays(tmp_path, code):
    target = write_folder(tmp_path / "out", _writer({"a.txt": "old", "b.txt": "old"}))
    before = _snapshot(tmp_path)

    def full(staging: Path) -> None:
        (staging / "a.txt").write_text("half")
        raise OSError(code, os.strerror(code))

    with pytest.raises(OSError, match=rf"disk is full .*{target} was not changed") as error:
        write_folder(target, full)
    assert error.value.errno == code
    assert _snapshot(tmp_path) == before


FSIZE_CHILD = """
import resource, signal, sys
from pathlib import Path
from depthfusion_hf.safe_folder import write_folder
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
def write(staging):
    (staging / "small.txt").write_text("fits")
    (staging / "model.safetensors").write_bytes(b"x" * 100_000)
try:
    write_folder(sys.argv[1], write)
except OSError as error:
    print("ERROR", error)
"""


@pytest.mark.parametrize("limit", [0, 4096])  # 0: already the staging folder's marker does not fit
def test_a_real_file_size_limit_mid_export_keeps_the_old_export(tmp_path, limit):
    target = write_folder(tmp_path / "out", _writer({"model.safetensors": "good weights"}))
    before = _snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(target), str(limit)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ERROR" in proc.stdout and "disk is full" in proc.stdout and "was not changed" in proc.stdout
    assert _snapshot(tmp_path) == before


def test_a_failed_second_rename_puts_the_old_export_back(tmp_path, monkeypatch):
    target = write_folder(tmp_path / "out", _writer({"a.txt": "old"}))
    before = _snapshot(tmp_path)
    real_replace = os.replace

    def failing(src, dst):
        if ".tmp-" in str(src) and Path(dst) == target:
            raise OSError(errno.EIO, "I/O error")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="I/O error"):
        write_folder(target, _writer({"a.txt": "new"}))
    assert _snapshot(tmp_path) == before


def test_an_old_export_that_cannot_be_emptied_leaves_the_new_one_in_place(tmp_path, monkeypatch):
    """After the swap the new export stands; a backup that cannot be deleted (read-only) is kept and named."""
    target = write_folder(tmp_path / "out", _writer({"a.txt": "old"}))

    def read_only(*args):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("depthfusion_hf.safe_folder.remove_if_unchanged", read_only)
    with pytest.warns(UserWarning, match="could not be removed"):
        write_folder(target, _writer({"a.txt": "new"}))
    assert (target / "a.txt").read_text() == "new"
    (backup,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
    assert (backup / "a.txt").read_text() == "old"


def test_a_writer_that_makes_a_symlink_is_refused(tmp_path):
    def write(staging: Path) -> None:
        (staging / "config.json").write_text("{}")
        (staging / "link").symlink_to("/etc/passwd")

    with pytest.raises(ValueError, match="link, which is a symlink"):
        write_folder(tmp_path / "out", write)
    assert list(tmp_path.iterdir()) == []
