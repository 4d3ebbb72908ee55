"""The run store: one JSON file per finished run, written atomically; a rerun skips the runs it finds and refuses a
folder whose runs used other settings."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any


def _flatten(settings: dict, prefix: str = "") -> dict:
    """``{"train": {"max_steps": 6}}`` -> ``{"train.max_steps": 6}``."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def write_json_atomic(path: Path, value) -> None:
    """Write ``value`` as JSON to ``path`` through a temporary file in the same folder."""
    write_text_atomic(path, json.dumps(value, indent=2))


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder (readers see old or new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        out.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o666 & ~umask)  # mkstemp creates 0600; give the file an ordinary file's mode
    os.replace(temporary, path)


class SettingsMismatch(ValueError):
    """A study folder holds runs made with other settings; mixing them would compare unlike runs."""


class RunStore:
    """Finished runs of a study, one JSON file each under ``<folder>/runs/``.

    A run file is written (to a temporary name, then renamed) only when its run has finished, so an
    interrupted study leaves only complete runs; a rerun skips every run whose key it finds. Every run
    stores the study's ``settings``; a store refuses to add to or read runs with other settings
    (:class:`SettingsMismatch`), so a changed command never mixes its runs with the old ones silently.
    """

    def __init__(self, folder: str | os.PathLike, settings: dict):
        self.folder = Path(folder)
        self.runs_dir = self.folder / "runs"
        self.settings = json.loads(json.dumps(settings, default=str))  # as it will read back

    @staticmethod
    def key(**parts: Any) -> str:
        """A file-name-safe key from the run's identifying parts (spec, layers, seed, ...)."""
        text = "-".join(f"{name}={parts[name]}" for name in sorted(parts))
        return re.sub(r"[^A-Za-z0-9=.+_-]", "_", text)

    def path(self, key: str) -> Path:
        """Where the run ``key`` is stored."""
        return self.runs_dir / f"{key}.json"

    def _check(self, record: dict, path: Path) -> dict:
        if record.get("settings") != self.settings:
            theirs, ours = _flatten(record.get("settings") or {}), _flatten(self.settings)
            diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
            raise SettingsMismatch(f"{path} was made with other settings (differing: {diff}); use another "
                                   "output folder, or the same command as the stored runs")
        return record

    def get(self, key: str) -> dict | None:
        """The stored run ``key`` or ``None``; :class:`SettingsMismatch` when it used other settings."""
        path = self.path(key)
        if not path.exists():
            return None
        return self._check(json.loads(path.read_text(encoding="utf-8")), path)

    def find(self, spec: str, **parts: Any) -> tuple[str, dict | None]:
        """The key of model ``spec`` at ``parts`` (layers, seed, ...) and its stored run, or ``None`` when not stored;
        :class:`SettingsMismatch` when that run used other settings."""
        key = self.key(model=spec, **parts)
        return key, self.get(key)

    def put(self, key: str, record: dict) -> Path:
        """Store a finished run (with the study's settings) atomically; returns its file."""
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        record = dict(record, key=key, settings=self.settings)
        path = self.path(key)
        write_text_atomic(path, json.dumps(record, indent=1, default=str))
        return path

    def records(self) -> list[dict]:
        """Every stored run (sorted by key); :class:`SettingsMismatch` if one used other settings."""
        if not self.runs_dir.is_dir():
            return []
        paths = sorted(self.runs_dir.glob("*.json"))
        return [self._check(json.loads(p.read_text(encoding="utf-8")), p) for p in paths]


__all__ = ["RunStore", "SettingsMismatch", "write_json_atomic", "write_text_atomic"]
