"""Exports into a folder that is a mount point (a Docker volume, a mounted disk; issue 27 §4).

No rename crosses a mount point (``OSError: [Errno 18] Invalid cross-device link``) and a mount point itself
cannot be renamed, so an export cannot be staged beside such a target and swapped in. The tests make
``target`` behave like one: every rename between a path inside it and a path outside raises ``EXDEV``, and
``os.path.ismount`` says so (or, for a bind mount on the same disk, does not).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM
from depthfusion_hf.export import check_export_folder, save_remote_code_folder
from depthfusion_hf.safe_folder import MARKER, ExportTargetError, load_marker, write_folder

from .test_export_safety import _hidden_siblings, _tree, _writer


def _inside(path, target: Path) -> bool:
    path = Path(os.path.abspath(path))
    return path == target or target in path.parents


@pytest.fixture
def mount_point(request, tmp_path, monkeypatch):
    """``tmp_path / "volume"`` as a mount point: renames across its boundary fail with EXDEV. With the parameter
    ``bind`` (indirect) true, ``os.path.ismount`` says False, as for a bind mount of the same file system."""
    target = tmp_path / "volume"
    target.mkdir()
    real_replace, real_rename, real_ismount = os.replace, os.rename, os.path.ismount
    bind = getattr(request, "param", False)

    def crossing(rename):
        def guarded(src, dst, *args, **kwargs):
            if _inside(src, target) != _inside(dst, target) or Path(os.path.abspath(src)) == target:
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))
            return rename(src, dst, *args, **kwargs)
        return guarded

    monkeypatch.setattr(os, "replace", crossing(real_replace))
    monkeypatch.setattr(os, "rename", crossing(real_rename))
    monkeypatch.setattr(os.path, "ismount", lambda path: (not bind and Path(os.path.abspath(path)) == target)
                        or real_ismount(path))
    return target


def _volume_files(target: Path) -> list[str]:
    return sorted(p.name for p in target.iterdir())


def test_a_model_exported_with_overwrite_into_a_mount_point_keeps_the_volumes_entries(mount_point):
    (mount_point / "lost+found").mkdir()
    (mount_point / "notes.txt").write_text("the user's")
    before = _tree(mount_point)
    torch.manual_seed(0)
    model = DenseFormerForCausalLM(DenseFormerConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                     num_hidden_layers=2, num_attention_heads=2))
    with pytest.raises(ExportTargetError, match="notes.txt"):  # without overwrite: refused as before
        save_remote_code_folder(model, mount_point)
    save_remote_code_folder(model, mount_point, overwrite=True)
    assert {k: v for k, v in _tree(mount_point).items() if k in before} == before
    assert (mount_point / "lost+found").is_dir() and check_export_folder(mount_point) == []
    assert set(load_marker(mount_point).files) >= {"config.json", "model.safetensors"}
    save_remote_code_folder(model, mount_point, overwrite=True)  # and again over its own export
    assert check_export_folder(mount_point) == [] and (mount_point / "notes.txt").read_text() == "the user's"
    assert [name for name in _volume_files(mount_point) if name.startswith(".") and name != MARKER] == []
    assert _hidden_siblings(mount_point) == []


@pytest.mark.parametrize("mount_point", [False, True], ids=["mounted disk", "bind mount"], indirect=True)
def test_an_empty_mount_point_takes_an_export_and_the_next_export_replaces_it(mount_point):
    write_folder(mount_point, _writer({"a.txt": "1", "sub/b.txt": "1"}))
    assert (mount_point / "sub" / "b.txt").read_text() == "1" and list(load_marker(mount_point).files) == ["a.txt",
                                                                                                          "sub/b.txt"]
    write_folder(mount_point, _writer({"a.txt": "2"}))  # a previous export: replaced without overwrite
    assert _volume_files(mount_point) == [MARKER, "a.txt"] and (mount_point / "a.txt").read_text() == "2"
    (mount_point / "a.txt").write_text("edited")
    with pytest.raises(ExportTargetError, match="changed since"):
        write_folder(mount_point, _writer({"a.txt": "3"}))
    assert (mount_point / "a.txt").read_text() == "edited" and _volume_files(mount_point) == [MARKER, "a.txt"]
    assert _hidden_siblings(mount_point) == []


def test_a_failed_write_into_a_mount_point_leaves_the_old_export(mount_point):
    write_folder(mount_point, _writer({"a.txt": "old"}))
    before = _tree(mount_point)

    def full(staging: Path) -> None:
        (staging / "a.txt").write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match="disk is full"):
        write_folder(mount_point, full)
    assert _tree(mount_point) == before
