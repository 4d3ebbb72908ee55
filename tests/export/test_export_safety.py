"""Exports never delete or replace what the package did not write (issue 9 §1).

Most cases use ``write_folder`` with a tiny writer (the rules live there); the model-level cases use
``save_remote_code_folder`` / ``export_model`` on a tiny DenseFormer, and one kills an export with SIGKILL.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM
from depthfusion_hf.export import check_export_folder, export_model, save_remote_code_folder
from depthfusion_hf.safe_folder import (
    MARKER,
    ExportTargetError,
    check_target,
    clean_stale_staging,
    load_marker,
    write_folder,
)

REPO = Path(__file__).resolve().parents[2]


def _writer(files: dict[str, str]):
    def write(staging: Path) -> None:
        for name, text in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_text(text)

    return write


def _tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256), symlinks not followed."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root) / name
            out[path.relative_to(folder).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _hidden_siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith("."))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _foreign_folder(path: Path) -> Path:
    """A training-run-like folder: notes and a checkpoint sub-folder, none of it written by an export."""
    (path / "checkpoint-500").mkdir(parents=True)
    (path / "checkpoint-500" / "optimizer.pt").write_bytes(b"\x00" * 64)
    (path / "notes.txt").write_text("my notes")
    return path


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = DenseFormerConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, max_position_embeddings=32)
    return DenseFormerForCausalLM(config).eval()


def test_new_folder_is_marked_with_the_files_it_holds(tmp_path):
    target = write_folder(tmp_path / "out", _writer({"a.txt": "1", "sub/b.txt": "2"}))
    assert target == (tmp_path / "out").resolve()
    assert list(load_marker(target).files) == ["a.txt", "sub/b.txt"]
    assert sorted(_tree(target)) == [MARKER, "a.txt", "sub/b.txt"]
    assert _hidden_siblings(target) == []


def test_previous_export_is_replaced_and_its_stale_files_go(tmp_path):
    target = write_folder(tmp_path / "out", _writer({"a.txt": "old", "b.txt": "old"}))
    write_folder(target, _writer({"a.txt": "new"}))
    assert (target / "a.txt").read_text() == "new" and not (target / "b.txt").exists()
    assert list(load_marker(target).files) == ["a.txt"]
    assert _hidden_siblings(target) == []  # no staging or backup folder left


def test_empty_folder_is_filled(tmp_path):
    (tmp_path / "out").mkdir()
    write_folder(tmp_path / "out", _writer({"a.txt": "1"}))
    assert (tmp_path / "out" / "a.txt").read_text() == "1"


def test_foreign_folder_is_refused_by_name_and_left_untouched(tmp_path):
    target = _foreign_folder(tmp_path / "run")
    before = _tree(target)
    with pytest.raises(ExportTargetError) as error:
        write_folder(target, _writer({"a.txt": "1"}))
    message = str(error.value)
    assert str(target.resolve()) in message and "checkpoint-500/" in message and "notes.txt" in message
    assert "not an export of this package" in message and "overwrite" in message
    assert _tree(target) == before and _hidden_siblings(target) == []


def test_previous_export_with_added_files_is_refused_then_kept_with_overwrite(tmp_path):
    target = write_folder(tmp_path / "out", _writer({"a.txt": "old", "b.txt": "old"}))
    (target / "notes.txt").write_text("mine")
    (target / "extra").mkdir()
    (target / "extra" / "x.bin").write_bytes(b"x")
    before = _tree(target)
    with pytest.raises(ExportTargetError, match=r"did not write: extra/, notes.txt"):
        write_folder(target, _writer({"a.txt": "new"}))
    assert _tree(target) == before
    write_folder(target, _writer({"a.txt": "new", "c.txt": "new"}), overwrite=True)
    assert (target / "notes.txt").read_text() == "mine" and (target / "extra" / "x.bin").read_bytes() == b"x"
    assert (target / "a.txt").read_text() == "new" and (target / "c.txt").read_text() == "new"
    assert not (target / "b.txt").exists()  # the previous export's own file, not written again
    assert list(load_marker(target).files) == ["a.txt", "c.txt"]
    assert _hidden_siblings(target) == []


def test_overwrite_writes_beside_foreign_entries_and_never_replaces_a_foreign_file(tmp_path):
    target = _foreign_folder(tmp_path / "run")
    foreign = _tree(target)
    write_folder(target, _writer({"a.txt": "1"}), overwrite=True)
    assert {k: v for k, v in _tree(target).items() if k in foreign} == foreign  # every foreign file kept as it was
    assert (target / "a.txt").read_text() == "1" and list(load_marker(target).files) == ["a.txt"]
    before = _tree(target)
    with pytest.raises(ExportTargetError, match=r"with the names of files the export writes.*: notes.txt"):
        write_folder(target, _writer({"a.txt": "2", "notes.txt": "clobber"}), overwrite=True)
    assert _tree(target) == before and _hidden_siblings(target) == []


def test_a_foreign_file_named_like_the_marker_is_not_replaced(tmp_path):
    target = tmp_path / "run"
    target.mkdir()
    (target / MARKER).write_text("not ours")
    with pytest.raises(ExportTargetError, match=MARKER):
        write_folder(target, _writer({"a.txt": "1"}), overwrite=True)
    assert (target / MARKER).read_text() == "not ours" and not (target / "a.txt").exists()


def test_current_directory_is_refused_even_when_it_is_a_previous_export(tmp_path, monkeypatch):
    work = _foreign_folder(tmp_path / "work")
    monkeypatch.chdir(work)
    before = _tree(work)
    with pytest.raises(ExportTargetError, match="notes.txt"):
        write_folder(".", _writer({"a.txt": "1"}))
    assert _tree(work) == before
    export = write_folder(tmp_path / "exp", _writer({"a.txt": "1"}))
    monkeypatch.chdir(export)
    with pytest.raises(ExportTargetError, match="current working directory"):
        write_folder(".", _writer({"a.txt": "2"}))
    assert (export / "a.txt").read_text() == "1"
    inode = os.stat(".").st_ino
    write_folder(".", _writer({"a.txt": "2"}), overwrite=True)  # updated in place: the directory is not renamed
    assert os.stat(".").st_ino == inode and Path.cwd() == export and Path("a.txt").read_text() == "2"


def test_symlink_to_a_foreign_folder_is_refused_and_to_an_export_is_followed(tmp_path):
    real = _foreign_folder(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    before = _tree(real)
    with pytest.raises(ExportTargetError, match="notes.txt") as error:
        write_folder(link, _writer({"a.txt": "1"}))
    assert str(real.resolve()) in str(error.value)
    assert _tree(real) == before and link.is_symlink()
    exported = write_folder(tmp_path / "exported", _writer({"a.txt": "old"}))
    link2 = tmp_path / "link2"
    link2.symlink_to(exported)
    write_folder(link2, _writer({"a.txt": "new"}))
    assert link2.is_symlink() and (link2 / "a.txt").read_text() == "new" and (exported / "a.txt").read_text() == "new"


def test_file_and_dangling_symlink_targets_are_refused_even_with_overwrite(tmp_path):
    target = tmp_path / "model"
    target.write_text("a file the user owns")
    for overwrite in (False, True):
        with pytest.raises(ExportTargetError, match="is a file, not a folder"):
            write_folder(target, _writer({"a.txt": "1"}), overwrite=overwrite)
    assert target.read_text() == "a file the user owns"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ExportTargetError, match="symlink to nothing"):
        write_folder(dangling, _writer({"a.txt": "1"}), overwrite=True)
    assert not (tmp_path / "nowhere").exists()


def test_check_target_fails_before_any_work(tmp_path):
    assert not check_target(tmp_path / "new").exists
    with pytest.raises(ExportTargetError, match="notes.txt"):
        check_target(_foreign_folder(tmp_path / "run"))
    assert check_target(tmp_path / "run", overwrite=True).foreign == ("checkpoint-500/", "notes.txt")


def test_stale_staging_of_dead_processes_is_cleaned_and_nothing_else(tmp_path):
    from depthfusion_hf.safe_folder import _new_staging

    target = write_folder(tmp_path / "out", _writer({"a.txt": "1"}))
    dead, alive = _dead_pid(), os.getppid()

    def staging(for_target: Path, pid: int, marked: bool) -> Path:
        if marked:  # made as the export makes it (the marker records the folder's own identity)
            folder = _new_staging(for_target, pid=pid)
        else:
            folder = tmp_path / f".{for_target.name}.tmp-{pid}-def67890"
            folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
        return folder

    stale = staging(target, dead, marked=True)
    unmarked = staging(target, dead, marked=False)
    live = staging(target, alive, marked=True)
    other_name = staging(tmp_path / "other", dead, marked=True)
    old_export = write_folder(tmp_path / "old", _writer({"a.txt": "old export file"}))
    backup = tmp_path / f".out.old-{dead}-mno11223"
    os.replace(old_export, backup)  # a process that died between its two renames leaves the old export here
    (backup / "user.txt").write_text("written by the user into the backup")

    with pytest.warns(UserWarning, match="did not write"):
        write_folder(target, _writer({"a.txt": "2"}))
    assert not stale.exists()
    assert unmarked.exists() and live.exists() and other_name.exists()
    assert (backup / "user.txt").exists() and not (backup / "a.txt").exists()
    assert (target / "a.txt").read_text() == "2"
    assert clean_stale_staging(target) == []  # nothing more to clean


def test_model_export_into_a_run_folder_is_refused_and_overwrite_keeps_it(tiny, tmp_path):
    run = _foreign_folder(tmp_path / "run")
    before = _tree(run)
    with pytest.raises(ExportTargetError, match="checkpoint-500/"):
        save_remote_code_folder(tiny, run)
    assert _tree(run) == before
    save_remote_code_folder(tiny, run, overwrite=True)
    assert {k: v for k, v in _tree(run).items() if k in before} == before
    assert check_export_folder(run) == []
    assert set(load_marker(run).files) >= {"config.json", "model.safetensors", "modeling_denseformer.py"}


def test_bad_repo_id_is_refused_before_anything_is_written(tiny, tmp_path):
    with pytest.raises(ValueError, match="user/name"):
        export_model(tiny, tmp_path / "exp", repo_id="no namespace")
    assert list(tmp_path.iterdir()) == []


def test_push_script_validates_everything_before_writing(tmp_path):
    """``--repo-id`` and a foreign ``--output-dir`` (here: the working directory ``.``) are refused up front."""
    model = tmp_path / "model"
    save_remote_code_folder(DenseFormerForCausalLM(DenseFormerConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)), model)
    work = _foreign_folder(tmp_path / "work")
    before = _tree(work)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    env.pop("HF_TOKEN", None)
    script = str(REPO / "scripts" / "push_to_hub.py")
    bad_id = subprocess.run([sys.executable, script, str(model), "--repo-id", "bad id", "--output-dir", "out"],
                            cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert bad_id.returncode == 2 and "repo_id must look like 'user/name'" in bad_id.stderr
    cwd = subprocess.run([sys.executable, script, str(model), "--repo-id", "me/x", "--output-dir", ".",
                          "--dry-run"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert cwd.returncode == 1 and "notes.txt" in cwd.stderr and "--overwrite" in cwd.stderr
    assert _tree(work) == before


CHILD = """
import sys, time, torch
from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM
from depthfusion_hf.export import save_remote_code_folder

class SlowTokenizer:
    def save_pretrained(self, folder):
        print("STAGING", folder, flush=True)
        time.sleep(120)

config = DenseFormerConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, max_position_embeddings=32)
save_remote_code_folder(DenseFormerForCausalLM(config), {target!r}, tokenizer=SlowTokenizer())
"""


def test_export_killed_mid_write_keeps_the_old_folder_and_the_next_export_cleans_up(tiny, tmp_path):
    target = save_remote_code_folder(tiny, tmp_path / "exp")
    before = _tree(target)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD.format(target=str(target)))],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        line = child.stdout.readline()
        assert line.startswith("STAGING "), line
        staging = Path(line.split(" ", 1)[1].strip())
        assert (staging / "model.safetensors").is_file()  # killed with the weights written, tokenizer pending
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert _tree(target) == before  # the old export survived
    assert staging.is_dir() and staging.name.startswith(f".exp.tmp-{child.pid}-") and load_marker(staging) is not None
    save_remote_code_folder(tiny, target)
    assert not staging.exists() and _hidden_siblings(target) == []
    assert check_export_folder(target) == []
