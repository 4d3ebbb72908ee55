"""D1's probe (issue 19 §1 and §7): exports (markers, siblings, links, edited files, permissions, full disks,
checks, uploads) and data files (encodings, BOMs, line ends, separators, empty and huge files, limits, samplers,
NER settings). Run against a checkout's src (PYTHONPATH) and print one JSON line per case and a summary.

Each case returns "ok", or one of: "silent" (a wrong result or a bad input accepted without a word), "loss"
(a file the package did not write, or one the user edited, was deleted or changed; or a path outside the
target was touched), "crash" (an internal exception type: KeyError, TypeError, IndexError, JSONDecodeError
without the file, ...), "unclear" (the right kind of error but a message that does not name what it must),
"hang" (a case still running after 180 s). A gate run by hand, not a test (docs/RELIABILITY.md has the counts):
the cases that found bugs are tests in ``tests/export/test_export_*.py`` and ``tests/dwatt/test_data_*.py``.

    .venv/bin/python scripts/probes/probe_files.py > after.jsonl                   # this checkout
    PYTHONPATH=/work/before/src .venv/bin/python scripts/probes/probe_files.py > before.jsonl   # another one
    .venv/bin/python scripts/probes/probe_files.py "edited files"                  # one area (substring)

The "loss" oracle is strict: a case that only replaced an entry without losing content (a FIFO or a symlink
at a listed name, an unchanged file made unreadable) also reads "loss"; docs/RELIABILITY.md counts those 5 cases
of the code before as silent. The permission cases drop root's CAP_DAC_OVERRIDE with ``setpriv``.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.simplefilter("ignore")

import depthfusion_hf  # noqa: E402,F401
from depthfusion_hf import data as D  # noqa: E402
from depthfusion_hf import export as HUB  # noqa: E402
from depthfusion_hf import remote_code as RC  # noqa: E402
from depthfusion_hf import safe_folder as SF  # noqa: E402
from depthfusion_hf.data import corpus  # noqa: E402
from depthfusion_hf.recipes import ner as NER  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/
import push_to_hub as PUSH  # noqa: E402

MARKER = SF.MARKER
ROOT = Path(tempfile.mkdtemp(prefix="d1probe_"))
CASES: list[tuple[str, str, object]] = []
INTERNAL = (KeyError, IndexError, TypeError, AttributeError, AssertionError, UnicodeDecodeError, RecursionError,
            OverflowError, ZeroDivisionError, NameError, StopIteration)


def case(area: str, name: str):
    def register(fn):
        CASES.append((area, name, fn))
        return fn
    return register


def fresh(name: str) -> Path:
    path = ROOT / f"{len(os.listdir(ROOT)):04d}-{''.join(c if c.isalnum() else '_' for c in name)[:40]}"
    path.mkdir()
    return path


def snapshot(root: Path) -> dict[str, str]:
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
            else:
                out[key] = "special"
    return out


def judge_error(error: BaseException, needles) -> str:
    if isinstance(error, INTERNAL) or type(error).__name__ in ("JSONDecodeError", "SafetensorError"):
        if type(error).__name__ == "JSONDecodeError" or not isinstance(error, INTERNAL):
            message = str(error)
            if all(n in message for n in needles):
                return "ok"
        return "crash"
    message = str(error)
    return "ok" if all(str(n) in message for n in needles) else "unclear"


def expect_error(fn, *needles):
    try:
        result = fn()
    except SystemExit as error:
        return "ok" if all(str(n) in str(error.code) for n in needles) else "unclear"
    except BaseException as error:  # noqa: BLE001
        verdict = judge_error(error, needles)
        return verdict if verdict == "ok" else (verdict, f"{type(error).__name__}: {str(error)[:200]}")
    return ("silent", f"accepted, returned {str(result)[:120]!r}")


def expect_value(fn, expected):
    try:
        result = fn()
    except BaseException as error:  # noqa: BLE001
        kind = "crash" if isinstance(error, INTERNAL) or type(error).__name__ == "JSONDecodeError" else "unclear"
        return (kind, f"refused a valid input: {type(error).__name__}: {str(error)[:200]}")
    return "ok" if result == expected else ("silent", f"got {str(result)[:160]!r}, expected {str(expected)[:160]!r}")


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def writer(files: dict[str, str]):
    def fill(staging: Path) -> None:
        for name, text in files.items():
            write(staging / name, text)
    return fill


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def guarded(root: Path, action, protected, expect: str = "refuse", needles=()):
    """Run an export ``action``; ``protected``: paths (relative to root) that must be unchanged. ``expect``:
    "refuse" (an error naming ``needles``), "succeed", or "either" (only data safety is judged)."""
    before = {k: v for k, v in snapshot(root).items() if any(k == p or k.startswith(p + "/") for p in protected)}
    error = None
    try:
        action()
    except BaseException as caught:  # noqa: BLE001
        error = caught
    after = {k: v for k, v in snapshot(root).items() if any(k == p or k.startswith(p + "/") for p in protected)}
    if before != after:
        changed = sorted(set(before.items()) ^ set(after.items()))[:4]
        return ("loss", f"changed: {changed}; error: {type(error).__name__ if error else None}")
    if expect == "refuse":
        if error is None:
            return ("silent", "accepted")
        verdict = judge_error(error, needles)
        return verdict if verdict == "ok" else (verdict, f"{type(error).__name__}: {str(error)[:200]}")
    if expect == "succeed" and error is not None:
        verdict = "crash" if isinstance(error, INTERNAL) else "unclear"
        return (verdict, f"{type(error).__name__}: {str(error)[:200]}")
    return "ok"


def export(root: Path, files=None, name="out") -> Path:
    return SF.write_folder(root / name, writer(files or {"config.json": "{}", "model.safetensors": "w",
                                                       "README.md": "card"}))


def forge_marker(folder: Path, files, hashes=None, extra=None):
    data = {"written_by": "depthfusion-hf", "format": 2, "files": files}
    if hashes is not None:
        data.update(sha256=hashes, folder=[0, 0])
    data.update(extra or {})
    write(folder / MARKER, json.dumps(data))


# ============================================================ exports: untrusted marker entries

ESCAPES = ["../victim.txt", "../../victim.txt", "sub/../../victim.txt", "ABS", "//ABS", "./../victim.txt",
           "..//victim.txt", "..\\victim.txt", "../victim.txt/", "../victim.txt\n", "a/./../../victim.txt",
           "sub/../../../victim.txt"]
for entry in ESCAPES:
    for overwrite in (False, True):
        for hashed in (False, True):
            @case("export: marker entries", f"{entry!r} overwrite={overwrite} hashed={hashed}")
            def _(entry=entry, overwrite=overwrite, hashed=hashed):
                root = fresh("esc")
                victim = write(root / "victim.txt", "the user's")
                target = root / "out"
                write(target / "a.txt", "old")
                real = entry.replace("ABS", str(victim)) if "ABS" in entry else entry
                hashes = {"a.txt": sha("old"), real: sha("the user's")} if hashed else None
                forge_marker(target, ["a.txt", real], hashes)
                return guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "new"}), overwrite=overwrite),
                               ["victim.txt"], "refuse", [MARKER])  # out/a.txt is listed: replacing it is no loss

MALFORMED = {"files a string": "a.txt", "files a dict": {"a.txt": 1}, "files ints": [1, 2], "files None": [None],
             "empty entry": [""], "duplicate": ["a.txt", "a.txt"], "the marker itself": [MARKER],
             "nested marker": ["sub/" + MARKER], "control char": ["a\x00.txt"], "drive letter": ["C:/Windows/x"]}
for label, files in MALFORMED.items():
    @case("export: malformed marker", label)
    def _(files=files):
        root = fresh("mal")
        target = root / "out"
        write(target / "a.txt", "old")
        write(target / MARKER, json.dumps({"written_by": "depthfusion-hf", "format": 2, "files": files}))
        return guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "new"}), overwrite=True), [],
                       "refuse", [MARKER])


@case("export: malformed marker", "hash not hex")
def _():
    root = fresh("mal")
    target = root / "out"
    write(target / "a.txt", "old")
    write(target / MARKER, json.dumps({"written_by": "depthfusion-hf", "format": 2, "files": ["a.txt"],
                                       "sha256": {"a.txt": "zz"}, "folder": [1, 2]}))
    return guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "new"})), [], "refuse", [MARKER])


@case("export: malformed marker", "format from the future")
def _():
    root = fresh("mal")
    target = root / "out"
    write(target / "a.txt", "old")
    write(target / MARKER, json.dumps({"written_by": "depthfusion-hf", "format": 9, "files": ["a.txt"]}))
    return guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "new"})), [], "refuse", [MARKER])


for label, content in {"not JSON": b"{", "empty": b"", "latin-1": b'{"written_by": "depthfusion-hf\xe9"}',
                       "JSON null": b"null", "huge": b" " * (20 << 20)}.items():
    @case("export: malformed marker", f"marker {label} (a foreign file of that name)")
    def _(content=content):
        root = fresh("mal")
        target = root / "out"
        write(target / "a.txt", "old")
        write(target / MARKER, content)
        return guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "new"}), overwrite=True), ["out"],
                       "refuse", [MARKER])


@case("export: malformed marker", "marker is a symlink to a valid marker elsewhere")
def _():
    root = fresh("mal")
    elsewhere = root / "elsewhere"
    write(elsewhere / "a.txt", "the user's")
    forge_marker(elsewhere, ["a.txt"], {"a.txt": sha("the user's")})
    target = root / "out"
    write(target / "a.txt", "the user's")
    (target / MARKER).symlink_to(elsewhere / MARKER)
    return guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "new"})), ["out", "elsewhere"], "refuse",
                   ["a.txt"])


# ============================================================ exports: stale siblings

def sibling_case(kind: str, forgery: str):
    root = fresh("sib")
    target = export(root, {"a.txt": "1"})
    write(root / "victim.txt", "the user's")
    write(root / "elsewhere" / "a.txt", "the user's too")
    pid = {"overflow": "99999999999999999999", "zero": "0", "alive": str(os.getppid())}.get(forgery, str(dead_pid()))
    sibling = root / f".out.{kind}-{pid}-forged01"
    if forgery == "symlink":
        forge_marker(root / "elsewhere", ["a.txt"])
        sibling.symlink_to(root / "elsewhere")
    elif forgery == "file":
        write(sibling, "a file named like a sibling")
    else:
        write(sibling / "user.txt", "not the package's")
        write(sibling / "a.txt", "the user's copy")
        entry = "../victim.txt" if forgery == "escaping" else "a.txt"
        hashes = None if forgery in ("legacy", "overflow", "zero", "alive") else {
            "user.txt": sha("not the package's"),
            entry: sha("the user's" if forgery == "escaping" else "the user's copy")}
        forge_marker(sibling, ["user.txt", entry], hashes)
        if forgery == "marker-link":
            (sibling / MARKER).unlink()
            forge_marker(root / "elsewhere", ["a.txt"])
            (sibling / MARKER).symlink_to(root / "elsewhere" / MARKER)
    protected = ["victim.txt", "elsewhere", sibling.name]
    return guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "2"})), protected, "succeed")


for kind in ("tmp", "old"):
    for forgery in ("legacy", "wrong-identity", "escaping", "symlink", "file", "overflow", "zero", "alive",
                    "marker-link"):
        case("export: stale siblings", f".{kind}- {forgery}")(lambda kind=kind, forgery=forgery: sibling_case(kind,
                                                                                                             forgery))

KILLED_CHILD = """
import sys, time
from pathlib import Path
from depthfusion_hf.safe_folder import write_folder
def write(staging):
    (staging / "model.safetensors").write_bytes(b"half")
    print("STAGING", staging, flush=True)
    time.sleep(120)
write_folder(sys.argv[1], write)
"""


def killed_staging(target: Path) -> Path:
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(target)], stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    return Path(line.split(" ", 1)[1].strip())


@case("export: stale siblings", "a real staging folder of a killed export is cleaned")
def _():
    root = fresh("sib")
    target = export(root, {"a.txt": "1"})
    staging = killed_staging(target)
    SF.write_folder(target, writer({"a.txt": "2"}))
    return "ok" if not staging.exists() else ("silent", "the killed export's staging folder was left")


@case("export: stale siblings", "a copy of a killed export's staging folder is left alone")
def _():
    root = fresh("sib")
    target = export(root, {"a.txt": "1"})
    staging = killed_staging(target)
    copy = root / f".out.tmp-{dead_pid()}-copied99"
    shutil.copytree(staging, copy)
    write(copy / "user.txt", "added by the user")
    return guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "2"})), [copy.name], "succeed")


# ============================================================ exports: links inside and at the target

@case("export: links", "listed sub-folder replaced by a link out, overwrite, export writes under it")
def _():
    root = fresh("lnk")
    write(root / "outside" / "a.txt", "kept")
    target = export(root, {"sub/a.txt": "kept", "b.txt": "1"})
    shutil.rmtree(target / "sub")
    (target / "sub").symlink_to(root / "outside")
    return guarded(root, lambda: SF.write_folder(target, writer({"sub/a.txt": "new", "b.txt": "2"}), overwrite=True),
                   ["outside"], "refuse", ["sub"])


@case("export: links", "listed sub-folder replaced by a link out, overwrite, export does not write under it")
def _():
    root = fresh("lnk")
    write(root / "outside" / "a.txt", "kept")
    target = export(root, {"sub/a.txt": "kept", "b.txt": "1"})
    shutil.rmtree(target / "sub")
    (target / "sub").symlink_to(root / "outside")
    return guarded(root, lambda: SF.write_folder(target, writer({"b.txt": "2"}), overwrite=True), ["outside"],
                   "succeed")


@case("export: links", "foreign link to an outside folder, overwrite, export writes under its name")
def _():
    root = fresh("lnk")
    write(root / "outside" / "keep.txt", "kept")
    target = root / "run"
    write(target / "notes.txt", "mine")
    (target / "tokenizer").symlink_to(root / "outside")
    return guarded(root, lambda: SF.write_folder(target, writer({"tokenizer/vocab.txt": "v"}), overwrite=True),
                   ["outside", "run/notes.txt"], "refuse", ["tokenizer"])


@case("export: links", "listed file replaced by a link to a secret")
def _():
    root = fresh("lnk")
    write(root / "secret.txt", "secret")
    target = export(root, {"config.json": "{}"})
    (target / "config.json").unlink()
    (target / "config.json").symlink_to(root / "secret.txt")
    return guarded(root, lambda: SF.write_folder(target, writer({"config.json": "{}"})), ["secret.txt", "out"],
                   "refuse", ["config.json"])


@case("export: links", "a foreign file where the export needs a folder, overwrite")
def _():
    root = fresh("lnk")
    target = root / "run"
    write(target / "tokenizer", "a file of the user's")
    return guarded(root, lambda: SF.write_folder(target, writer({"tokenizer/vocab.txt": "v"}), overwrite=True),
                   ["run/tokenizer"], "refuse", ["tokenizer"])


@case("export: links", "target is a symlink to a previous export (followed, link kept)")
def _():
    root = fresh("lnk")
    real = export(root, {"a.txt": "1"}, name="real")
    (root / "link").symlink_to(real)
    SF.write_folder(root / "link", writer({"a.txt": "2"}))
    ok = (root / "link").is_symlink() and (real / "a.txt").read_text() == "2"
    return "ok" if ok else ("silent", "the link or the export is wrong")


@case("export: links", "target is a dangling symlink")
def _():
    root = fresh("lnk")
    (root / "out").symlink_to(root / "nowhere")
    return guarded(root, lambda: SF.write_folder(root / "out", writer({"a.txt": "1"}), overwrite=True), ["out"],
                   "refuse", ["symlink to nothing"])


@case("export: links", "target is a FIFO")
def _():
    root = fresh("lnk")
    os.mkfifo(root / "out")
    return guarded(root, lambda: SF.write_folder(root / "out", writer({"a.txt": "1"}), overwrite=True), ["out"],
                   "refuse", ["not a folder"])


@case("export: links", "a writer that makes a symlink")
def _():
    root = fresh("lnk")

    def fill(staging: Path) -> None:
        write(staging / "config.json", "{}")
        (staging / "evil").symlink_to("/etc/passwd")

    return expect_error(lambda: SF.write_folder(root / "out", fill), "symlink")


# ============================================================ exports: edited files

EDITS = {
    "content": lambda p: p.write_text(p.read_text() + " edited"),
    "truncated": lambda p: p.write_text(""),
    "same size": lambda p: p.write_text("".join(chr(ord(c) ^ 1) for c in p.read_text())),
    "replaced by a folder": lambda p: (p.unlink(), p.mkdir(), write(p / "x", "mine")),
    "replaced by a fifo": lambda p: (p.unlink(), os.mkfifo(p)),
}
for name in ("README.md", "config.json", "model.safetensors"):
    for edit, change in EDITS.items():
        for overwrite in (False, True):
            @case("export: edited files", f"{name} {edit} overwrite={overwrite}")
            def _(name=name, change=change, overwrite=overwrite, edit=edit):
                root = fresh("edit")
                target = export(root)
                change(target / name)
                if not overwrite:
                    return guarded(root, lambda: SF.write_folder(target, writer({"config.json": "{}", "README.md": "c2",
                                                                                  "model.safetensors": "w2"})),
                                   [f"out/{name}"], "refuse", [name])
                if edit == "replaced by a folder":  # a foreign folder now: never replaced
                    return guarded(root, lambda: SF.write_folder(target, writer({name: "new"}), overwrite=True),
                                   [f"out/{name}"], "refuse", [name])
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    SF.write_folder(target, writer({name: "new"}), overwrite=True)
                said = any(name in str(w.message) and "replaced" in str(w.message) for w in caught)
                return "ok" if said else ("silent", "overwrite replaced the edited file without naming it")


@case("export: edited files", "chmod only (content unchanged) is not an edit")
def _():
    root = fresh("edit")
    target = export(root)
    os.chmod(target / "README.md", 0o600)
    return guarded(root, lambda: SF.write_folder(target, writer({"README.md": "c2"})), [], "succeed")


@case("export: edited files", "touched only (content unchanged) is not an edit")
def _():
    root = fresh("edit")
    target = export(root)
    os.utime(target / "README.md", (1, 1))
    return guarded(root, lambda: SF.write_folder(target, writer({"README.md": "c2"})), [], "succeed")


@case("export: edited files", "a listed file deleted by the user is no obstacle")
def _():
    root = fresh("edit")
    target = export(root)
    (target / "README.md").unlink()
    return guarded(root, lambda: SF.write_folder(target, writer({"README.md": "c2"})), [], "succeed")


@case("export: edited files", "a marker without format or hashes and an edited card, overwrite")
def _():
    root = fresh("edit")
    target = root / "out"
    write(target / "README.md", "edited by the user")
    write(target / "config.json", "{}")
    write(target / MARKER, json.dumps({"written_by": "depthfusion-hf", "version": "0.1.0",
                                       "files": ["README.md", "config.json"]}))
    return guarded(root, lambda: SF.write_folder(target, writer({"README.md": "new", "config.json": "{}"}),
                                                 overwrite=True), ["out"], "refuse", [MARKER, "format"])


@case("export: edited files", "an edited card through save_remote_code_folder")
def _():
    root = fresh("edit")
    model = tiny_model()
    target = RC.save_remote_code_folder(model, root / "out", model_card="---\nlicense: mit\n---\ncard\n")
    (target / "README.md").write_text("---\nlicense: mit\n---\nmy card\n")
    return guarded(root, lambda: RC.save_remote_code_folder(model, target, model_card="---\nlicense: mit\n---\nx\n"),
                   ["out/README.md"], "refuse", ["README.md"])


@case("export: edited files", "a hand-tuned config.json through save_remote_code_folder")
def _():
    root = fresh("edit")
    model = tiny_model()
    target = RC.save_remote_code_folder(model, root / "out")
    config = json.loads((target / "config.json").read_text())
    config["rope_theta"] = 12345.0
    (target / "config.json").write_text(json.dumps(config))
    return guarded(root, lambda: RC.save_remote_code_folder(model, target), ["out/config.json"], "refuse",
                   ["config.json"])


_MODEL = []


def tiny_model():
    if not _MODEL:
        import torch

        from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM
        torch.manual_seed(0)
        _MODEL.append(DenseFormerForCausalLM(DenseFormerConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=32)))
    return _MODEL[0]


# ============================================================ exports: failures while writing

for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
    @case("export: full disk", f"{errno.errorcode[code]} while the writer runs")
    def _(code=code):
        root = fresh("disk")
        target = export(root, {"a.txt": "good"})

        def full(staging: Path) -> None:
            write(staging / "a.txt", "half")
            raise OSError(code, os.strerror(code))

        verdict = guarded(root, lambda: SF.write_folder(target, full), ["out"], "refuse", ["disk is full"])
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
        return verdict if not leftovers or verdict != "ok" else ("silent", f"left {leftovers}")

FSIZE_CHILD = """
import resource, signal, sys
from depthfusion_hf.safe_folder import write_folder
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
def write(staging):
    (staging / "small.txt").write_text("fits")
    (staging / "model.safetensors").write_bytes(b"x" * 100_000)
try:
    write_folder(sys.argv[1], write)
    print("NO ERROR")
except OSError as error:
    print("ERROR", error)
"""
for limit in (0, 50, 4096, 65536):
    @case("export: full disk", f"RLIMIT_FSIZE={limit} in a child")
    def _(limit=limit):
        root = fresh("disk")
        target = export(root, {"model.safetensors": "good weights"})
        before = snapshot(root)
        proc = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(target), str(limit)], capture_output=True,
                              text=True, timeout=120)
        if snapshot(root) != before:
            return ("loss", f"changed {sorted(set(snapshot(root)) ^ set(before))[:4]}: {proc.stdout[-200:]}")
        if proc.returncode != 0:
            return ("crash", proc.stderr[-300:])
        return "ok" if "ERROR" in proc.stdout and "disk" in proc.stdout else ("unclear", proc.stdout[-200:])


@case("export: full disk", "the second rename fails: the old export is put back")
def _():
    root = fresh("disk")
    target = export(root, {"a.txt": "old"})
    real = os.replace

    def failing(src, dst):
        if ".tmp-" in str(src) and Path(dst) == target:
            raise OSError(errno.EIO, "I/O error")
        return real(src, dst)

    os.replace = failing
    try:
        return guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "new"})), ["out"], "refuse", ["I/O"])
    finally:
        os.replace = real


@case("export: full disk", "interrupted in-place update, then finished")
def _():
    root = fresh("disk")
    target = root / "run"
    write(target / "notes.txt", "mine")
    SF.write_folder(target, writer({"a.txt": "1", "b.txt": "1"}), overwrite=True)
    real = os.replace

    def failing(src, dst):
        if Path(dst) == target / "b.txt":
            raise KeyboardInterrupt
        return real(src, dst)

    os.replace = failing
    try:
        SF.write_folder(target, writer({"a.txt": "2", "b.txt": "2"}), overwrite=True)
    except KeyboardInterrupt:
        pass
    finally:
        os.replace = real
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SF.write_folder(target, writer({"a.txt": "3", "b.txt": "3"}), overwrite=True)
    spurious = [str(w.message) for w in caught if "replaced" in str(w.message)]
    if spurious:
        return ("silent", f"the package's own half-updated files counted as edited: {spurious[0][:120]}")
    return "ok" if (target / "notes.txt").read_text() == "mine" else ("loss", "notes.txt")


# ============================================================ exports: permissions (a child as nobody)

PERM_CHILD = """
import os, sys, json
from depthfusion_hf.safe_folder import write_folder
def fill(staging):
    (staging / "a.txt").write_text("new")
try:
    write_folder(sys.argv[1], fill, overwrite=sys.argv[2] == "1")
    print(json.dumps({"ok": True}))
except BaseException as error:
    print(json.dumps({"ok": False, "type": type(error).__name__, "message": str(error)}))
"""


def perm_case(setup, overwrite: bool, needles):
    root = fresh("perm")
    target = setup(root)
    setup_modes = getattr(setup, "modes", None)
    if setup_modes:
        setup_modes(root)
    before = snapshot(root)
    proc = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all", "--",
                           sys.executable, "-c", PERM_CHILD, str(target), "1" if overwrite else "0"],
                          capture_output=True, text=True, timeout=120, cwd="/")
    if snapshot(root) != before and needles:
        return ("loss", f"changed {sorted(set(before.items()) ^ set(snapshot(root).items()))[:3]}")
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return ("crash", proc.stderr[-300:])
    if not needles:
        return "ok" if result["ok"] else ("unclear", result["message"][:200])
    if result["ok"]:
        return ("silent", "accepted")
    ok = all(n in result["message"] for n in needles) and result["type"] not in [e.__name__ for e in INTERNAL]
    return "ok" if ok else ("unclear", f"{result['type']}: {result['message'][:200]}")


def _unreadable_listed(root):
    target = export(root, {"a.txt": "1", "b.txt": "1"})
    return target


_unreadable_listed.modes = lambda root: os.chmod(next(root.glob("*/b.txt")), 0o000)


def _readonly_parent(root):
    parent = root / "parent"
    parent.mkdir()
    return parent / "out"


_readonly_parent.modes = lambda root: os.chmod(root / "parent", 0o555)


def _readonly_target(root):
    return export(root, {"a.txt": "1"})


_readonly_target.modes = lambda root: os.chmod(root / "out", 0o555)

case("export: permissions", "a listed file nobody can read counts as changed")(
    lambda: perm_case(_unreadable_listed, False, ["b.txt"]))
case("export: permissions", "a parent folder that is not writable")(
    lambda: perm_case(_readonly_parent, False, ["Permission denied"]))
case("export: permissions", "a read-only previous export (swap needs the parent only)")(
    lambda: perm_case(_readonly_target, False, []))
def _readonly_foreign(root):
    write(root / "out" / "n.txt", "mine")
    return root / "out"


_readonly_foreign.modes = lambda root: os.chmod(root / "out", 0o555)


def _readonly_parent_with_export(root):
    return export(root / "parent", {"a.txt": "1"})


_readonly_parent_with_export.modes = lambda root: os.chmod(root / "parent", 0o555)

case("export: permissions", "a read-only foreign folder with overwrite")(
    lambda: perm_case(_readonly_foreign, True, ["Permission denied"]))
case("export: permissions", "a previous export in a read-only parent")(
    lambda: perm_case(_readonly_parent_with_export, False, ["Permission denied"]))


# ============================================================ exports: mount points (issue 27)

@contextlib.contextmanager
def mounted(target: Path, bind: bool = False):
    """``target`` behaves as a mount point: a rename between inside and outside raises EXDEV (and renaming it
    does); ``os.path.ismount`` says so unless ``bind`` (a bind mount of the same file system)."""
    real_replace, real_rename, real_ismount = os.replace, os.rename, os.path.ismount

    def inside(path) -> bool:
        path = Path(os.path.abspath(path))
        return path == target or target in path.parents

    def crossing(rename):
        def guarded_rename(src, dst, *args, **kwargs):
            if inside(src) != inside(dst) or Path(os.path.abspath(src)) == target:
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))
            return rename(src, dst, *args, **kwargs)
        return guarded_rename

    os.replace, os.rename = crossing(real_replace), crossing(real_rename)
    os.path.ismount = lambda path: (not bind and Path(os.path.abspath(path)) == target) or real_ismount(path)
    try:
        yield
    finally:
        os.replace, os.rename, os.path.ismount = real_replace, real_rename, real_ismount


for bind in (False, True):
    @case("export: mount points", f"overwrite into a volume with lost+found and notes (bind mount={bind})")
    def _(bind=bind):
        root = fresh("mnt")
        target = root / "volume"
        write(target / "lost+found" / "x", "the system's")
        write(target / "notes.txt", "the user's")
        with mounted(target, bind):
            verdict = guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "1"}), overwrite=True),
                              ["volume/lost+found", "volume/notes.txt"], "succeed")
            if verdict == "ok" and (target / "a.txt").read_text() != "1":
                verdict = ("silent", "the export is not in the volume")
        return verdict

    @case("export: mount points", f"an empty volume, then a second export replaces the first (bind mount={bind})")
    def _(bind=bind):
        root = fresh("mnt")
        target = root / "volume"
        target.mkdir()
        with mounted(target, bind):
            first = guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "1", "b.txt": "1"})), [],
                            "succeed")
            if first != "ok":
                return first
            second = guarded(root, lambda: SF.write_folder(target, writer({"a.txt": "2"})), [], "succeed")
        names = sorted(p.name for p in target.iterdir())
        if second == "ok" and names != [MARKER, "a.txt"]:
            return ("silent", f"the volume holds {names}")
        return second


@case("export: mount points", "an edited file in a volume is refused by name and kept")
def _():
    root = fresh("mnt")
    target = root / "volume"
    target.mkdir()
    with mounted(target):
        SF.write_folder(target, writer({"README.md": "card"}))
        write(target / "README.md", "my card")
        return guarded(root, lambda: SF.write_folder(target, writer({"README.md": "new"})), ["volume/README.md"],
                       "refuse", ["README.md", "changed since"])


# ============================================================ exports: check_export_folder and uploads

def exported_copy() -> Path:
    root = fresh("chk")
    return RC.save_remote_code_folder(tiny_model(), root / "out")


CHECKS = {
    "config.json not JSON": ("config.json", b"{", "config.json"),
    "config.json empty": ("config.json", b"", "config.json"),
    "config.json null": ("config.json", b"null", "config.json"),
    "config.json an array": ("config.json", b"[]", "config.json"),
    "config.json with a BOM": ("config.json", codecs.BOM_UTF8 + b'{"model_type": "denseformer"}', "config.json"),
    "config.json latin-1": ("config.json", b'{"x": "\xe9"}', "config.json"),
    "config.json a folder": ("config.json", None, "config.json"),
    "model_type a list": ("config.json", b'{"model_type": ["denseformer"]}', "model_type"),
    "auto_map a string": ("config.json", b'{"model_type": "denseformer", "auto_map": "x"}', "auto_map"),
    "index broken": ("model.safetensors.index.json", b"{", "model.safetensors.index.json"),
    "index shard outside": ("model.safetensors.index.json", b'{"weight_map": {"w": "../x.safetensors"}}',
                            "x.safetensors"),
    "generation config broken": ("generation_config.json", b"{,", "generation_config.json"),
    "code file latin-1": ("modeling_denseformer.py", b"# \xe9\n", "modeling_denseformer.py"),
}
for label, (name, data, needle) in CHECKS.items():
    @case("export: check_export_folder", label)
    def _(name=name, data=data, needle=needle):
        folder = exported_copy()
        path = folder / name
        path.unlink(missing_ok=True)
        if data is None:
            path.mkdir()
        else:
            write(path, data)
        try:
            problems = RC.check_export_folder(folder)
        except BaseException as error:  # noqa: BLE001
            return ("crash", f"{type(error).__name__}: {str(error)[:200]}")
        if not problems:
            return ("silent", "no problem reported")
        return "ok" if any(needle in p for p in problems) else ("unclear", "; ".join(problems)[:200])


class FakeApi:
    calls: list = []

    def __init__(self, *args, **kwargs):
        pass

    def create_repo(self, *args, **kwargs):
        FakeApi.calls.append("create_repo")

    def upload_folder(self, **kwargs):
        from huggingface_hub.utils import filter_repo_objects
        folder = Path(kwargs["folder_path"])
        files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
        sent = list(filter_repo_objects(files, ignore_patterns=kwargs.get("ignore_patterns")))
        FakeApi.calls.append(("upload", sent, {f: (folder / f).read_bytes()[:64] for f in sent}))
        return "url"


def push(folder: Path, repo="me/x"):
    FakeApi.calls = []
    return HUB.push_folder_to_hub(folder, repo, token="t", api=FakeApi())


@case("export: uploads", "a marker in a sub-folder is not uploaded")
def _():
    folder = exported_copy()
    write(folder / "extra" / MARKER, "{}")
    push(folder)
    sent = FakeApi.calls[-1][1]
    return "ok" if not any(s.endswith(MARKER) for s in sent) else ("silent", f"uploaded {sent}")


@case("export: uploads", "the top-level marker is not uploaded")
def _():
    folder = exported_copy()
    push(folder)
    sent = FakeApi.calls[-1][1]
    return "ok" if MARKER not in sent else ("silent", "uploaded the marker")


for label, make in {"README.md -> a secret": lambda f, s: ((f / "README.md").symlink_to(s)),
                    "extra file -> a secret": lambda f, s: ((f / "notes.txt").symlink_to(s)),
                    "folder -> outside": lambda f, s: ((f / "extra").symlink_to(s.parent))}.items():
    @case("export: uploads", f"a symlink leading out: {label}")
    def _(make=make):
        folder = exported_copy()
        secret = write(folder.parent / "credentials", "hf_secret")
        make(folder, secret)
        try:
            push(folder)
        except (ValueError, OSError) as error:
            return "ok" if "symlink" in str(error) else ("unclear", str(error)[:200])
        leaked = any(b"hf_secret" in content for content in FakeApi.calls[-1][2].values())
        return ("loss", "the secret behind the link was uploaded") if leaked else ("silent", "accepted the link")


@case("export: uploads", "a folder whose marker lists ../victim.txt")
def _():
    folder = exported_copy()
    forge_marker(folder, ["../victim.txt"])
    return expect_error(lambda: push(folder), "victim.txt")


@case("export: uploads", "a FIFO in the folder")
def _():
    folder = exported_copy()
    os.mkfifo(folder / "pipe")
    return expect_error(lambda: push(folder), "pipe")


@case("export: uploads", "a missing folder")
def _():
    return expect_error(lambda: push(ROOT / "missing-folder"), "missing-folder")


for repo in ("me/..", "me/.x", "me/a--b", "me/a..b", "me/-x", "me/x-"):
    case("export: uploads", f"repo id {repo!r}")(lambda repo=repo: expect_error(lambda: HUB.validate_repo_id(repo),
                                                                                 "repo_id"))


@case("export: uploads", "load_export_model with a broken config JSON")
def _():
    path = write(fresh("cfg") / "c.json", '{"model_type": "moda",')
    return expect_error(lambda: PUSH.load_export_model(config_path=path), "c.json")


@case("export: uploads", "load_export_model with a config folder")
def _():
    path = fresh("cfg") / "c.json"
    path.mkdir()
    return expect_error(lambda: PUSH.load_export_model(config_path=path), "c.json")


@case("export: uploads", "load_card_results with broken JSON")
def _():
    path = write(fresh("cfg") / "results.json", "{")
    return expect_error(lambda: PUSH.load_card_results(path, "denseformer"), "results.json")


# ============================================================ data: text documents

BLANKS = [" ", "\t", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", "\xa0", "\u1680", *map(chr, range(0x2000, 0x200b)),
          "\u202f", "\u205f", "\u3000", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff"]
for blank in BLANKS:
    @case("data: text paragraphs", f"blank line holding U+{ord(blank):04X}")
    def _(blank=blank):
        path = write(fresh("txt") / "c.txt", f"First one.\n{blank}\nSecond one.\n")
        return expect_value(lambda: D.read_text_documents(path), ["First one.", "Second one."])

TEXTS = {
    "U+2029 paragraph separator": ("One.\u2029Two.", ["One.", "Two."]),
    "two U+2028 line separators": ("One.\u2028\u2028Two.", ["One.", "Two."]),
    "two NEL": ("One.\x85\x85Two.", ["One.", "Two."]),
    "CRLF converted twice": ("a\r\r\nb\r\r\n\r\r\nc", ["a\nb", "c"]),
    "old Mac CR": ("a\rb\r\rc", ["a\nb", "c"]),
    "mixed CRLF and LF blank": ("a\r\n\nb", ["a", "b"]),
    "a BOM of a joined file": ("a\n\n\ufeffb", ["a", "b"]),
    "no-break space inside a line": ("New\xa0York\n\nnext", ["New\xa0York", "next"]),
    "indented paragraphs": ("  a\n  b\n\n  c", ["a\n  b", "c"]),
    "trailing blanks": ("a  \n\t\n", ["a"]),
    "NUL inside text": ("a\x00b\n\nc", ["a\x00b", "c"]),
    "zero-width space alone is a blank line": ("a\n\u200b\u200b\nb", ["a", "b"]),
}
for label, (text, expected) in TEXTS.items():
    @case("data: text paragraphs", label)
    def _(text=text, expected=expected):
        path = write(fresh("txt") / "c.txt", text.encode())
        return expect_value(lambda: D.read_text_documents(path), expected)


@case("data: text paragraphs", "a 10 MB line")
def _():
    line = "word " * 2_000_000
    path = write(fresh("txt") / "c.txt", f"{line}\n\nnext")
    return expect_value(lambda: D.read_text_documents(path), [line.strip(), "next"])


@case("data: text paragraphs", "100,000 paragraphs")
def _():
    path = write(fresh("txt") / "c.txt", "\n \n".join(f"p{i}" for i in range(100_000)))
    return expect_value(lambda: len(D.read_text_documents(path)), 100_000)


# ============================================================ data: encodings and file kinds

ENCODED = {"UTF-16 LE BOM": codecs.BOM_UTF16_LE + "hi".encode("utf-16-le"),
           "UTF-16 BE BOM": codecs.BOM_UTF16_BE + "hi".encode("utf-16-be"),
           "UTF-32 LE BOM": codecs.BOM_UTF32_LE + "hi".encode("utf-32-le"),
           "latin-1": "café".encode("latin-1"), "cp1252 quote": b"\x93quoted\x94", "truncated UTF-8": b"caf\xc3"}
for label, data in ENCODED.items():
    for reader in ("text", "conll", "jsonl"):
        @case("data: encodings", f"{label} via {reader}")
        def _(data=data, reader=reader, label=label):
            folder = fresh("enc")
            if reader == "text":
                path = write(folder / "c.txt", data)
                return expect_error(lambda: D.read_text_documents(path), "c.txt:")
            if reader == "conll":
                path = write(folder / "c.conll", data)
                return expect_error(lambda: D.read_conll(path), "c.conll:")
            path = write(folder / "c.jsonl", data)
            return expect_error(lambda: D.read_json_documents(path), "c.jsonl:")


def not_a_file(kind: str) -> Path:
    folder = fresh("kind")
    if kind == "folder":
        (folder / "data.txt").mkdir()
        return folder / "data.txt"
    if kind == "dangling":
        (folder / "data.txt").symlink_to(folder / "nowhere")
        return folder / "data.txt"
    if kind == "fifo":
        os.mkfifo(folder / "data.txt")
        return folder / "data.txt"
    return Path("/dev/null")


for kind, needle in (("folder", "folder"), ("dangling", "symlink"), ("fifo", "regular file"),
                     ("device", "regular file")):
    for reader in ("read_text", "read_conll", "load_documents", "NerSettings", "read_config"):
        @case("data: file kinds", f"{kind} via {reader}")
        def _(kind=kind, reader=reader, needle=needle):
            path = not_a_file(kind)
            call = {"read_text": lambda: D.read_text(path), "read_conll": lambda: D.read_conll(path),
                    "load_documents": lambda: corpus.load_documents(files=[path]),
                    "NerSettings": lambda: NER.NerSettings(train_file=str(path), test_file=str(path)),
                    "read_config": lambda: NER.read_config(path)}[reader]
            return expect_error(call, needle)


@case("data: file kinds", "a symlink to a real file is read")
def _():
    folder = fresh("kind")
    write(folder / "real.txt", "a\n\nb")
    (folder / "link.txt").symlink_to(folder / "real.txt")
    return expect_value(lambda: D.read_text_documents(folder / "link.txt"), ["a", "b"])


# ============================================================ data: CoNLL

SPACES = ["\xa0", "\u2009", "\u3000", "\u2007", "\u202f", "\u205f", "\u1680", "\x1c", "\x1f", "\x0b", "\x0c",
          "\u2028", "\x85", "\u200a"]
for space in SPACES:
    for sep in ("\t", " "):
        @case("data: CoNLL tokens", f"token holding U+{ord(space):04X}, separator {sep!r}")
        def _(space=space, sep=sep):
            path = write(fresh("conll") / "t.conll", f"New{space}York{sep}B-LOC\nis{sep}O\n")
            return expect_value(lambda: D.read_conll(path), [{"tokens": [f"New{space}York", "is"],
                                                              "ner_tags": ["B-LOC", "O"]}])

CONLL = {
    "a no-break-space-only line ends a sentence": ("a\tO\n\xa0\nb\tO\n", [["a"], ["b"]]),
    "trailing tab": ("a\tO\t\nb\tO\n", [["a", "b"]]),
    "trailing spaces": ("a O   \nb O\n", [["a", "b"]]),
    "leading spaces": ("  a O\n  b O\n", [["a", "b"]]),
    "many spaces between columns": ("a     O\n", [["a"]]),
    "four columns": ("EU NNP B-NP B-ORG\n", [["EU"]]),
    "CRLF and BOM": ("\ufeffa\tO\r\n\r\nb\tO\r\n", [["a"], ["b"]]),
    "DOCSTART after a joined BOM": ("a\tO\n\n\ufeff-DOCSTART- O\n\nb\tO\n", [["a"], ["b"]]),
    "token that is a no-break space": ("\xa0\tO\nb\tO\n", [["\xa0", "b"]]),
    "10,000-token sentence": ("".join(f"w{i}\tO\n" for i in range(10_000)), [[f"w{i}" for i in range(10_000)]]),
}
for label, (text, expected) in CONLL.items():
    @case("data: CoNLL tokens", label)
    def _(text=text, expected=expected):
        path = write(fresh("conll") / "t.conll", text)
        return expect_value(lambda: [s["tokens"] for s in D.read_conll(path)], expected)


for label, (columns, needle) in {"token column out of range": ((0, 5), "column"),
                                 "tag column out of range": ((5, -1), "column"),
                                 "same column": ((0, 0), "same column"), "negative same": ((-1, -1), "same"),
                                 "float column": ((0.0, -1), "integer")}.items():
    @case("data: CoNLL tokens", label)
    def _(columns=columns, needle=needle):
        path = write(fresh("conll") / "t.conll", "John NNP B-PER\n")
        return expect_error(lambda: D.read_conll(path, *columns), needle)


# ============================================================ data: JSON forms

JSON_OK = {
    "pretty object": ('{\n  "text": "All of it."\n}\n', ["All of it."]),
    "compact object": ('{"text": "one"}', ["one"]),
    "pretty array": ('[\n  {"text": "a"},\n  {"text": "b"}\n]\n', ["a", "b"]),
    "JSONL with blank lines": ('{"text": "a"}\n\n\n{"text": "b"}\n', ["a", "b"]),
    "JSONL CRLF + BOM": ('\ufeff{"text": "a"}\r\n{"text": "b"}\r\n', ["a", "b"]),
    "JSONL with a joined BOM": ('{"text": "a"}\n\ufeff{"text": "b"}\n', ["a", "b"]),
    "escaped U+2028 inside a text": ('{"text": "a\\u2028b"}\n', ["a\u2028b"]),
    "raw U+2028 inside a JSONL text": ('{"text": "a\u2028b"}\n{"text": "c"}\n', ["a\u2028b", "c"]),
    "array on one line in .jsonl": ('[{"text": "a"}, {"text": "b"}]', ["a", "b"]),
    "blank texts skipped (NBSP, ZWSP)": ('[{"text": "\\u00a0"}, {"text": "\\u200b"}, {"text": "x"}]', ["x"]),
    "empty array": ("[]", []),
}
for label, (text, expected) in JSON_OK.items():
    @case("data: JSON forms", label)
    def _(text=text, expected=expected):
        path = write(fresh("json") / "c.jsonl", text.encode())
        return expect_value(lambda: D.read_json_documents(path), expected)

JSON_BAD = {
    "object without text": ('{\n "title": "x"\n}', "c.json"), "number": ("42", "c.json"), "string": ('"x"', "c.json"),
    "null": ("null", "c.json"), "nested data": ('{"data": [{"text": "a"}]}', "c.json"),
    "lone surrogate": ('{"text": "\\ud800"}', "c.json"), "pretty object broken": ('{\n "text": "a",\n}', "c.json:3"),
    "JSONL broken second line": ('{"text": "a"}\n{"text": \n', "c.json:2"),
    "text null": ('[{"text": null}]', "record 1"), "text number": ('[{"text": 1}]', "record 1"),
    "record a list": ('[["a"]]', "record 1"),
}
for label, (text, needle) in JSON_BAD.items():
    @case("data: JSON forms", label)
    def _(text=text, needle=needle):
        path = write(fresh("json") / "c.json", text)
        return expect_error(lambda: D.read_json_documents(path), needle)


@case("data: JSON forms", "a lone surrogate through the tokenizer (what the check prevents)")
def _():
    path = write(fresh("json") / "c.json", '{"text": "\\ud800 x"}')
    try:
        docs = D.read_json_documents(path)
    except ValueError as error:
        return "ok" if "c.json" in str(error) else ("unclear", str(error)[:200])
    try:
        corpus.train_bpe_tokenizer(docs, vocab_size=300)
    except BaseException as error:  # noqa: BLE001
        return ("crash", f"{type(error).__name__}: {str(error)[:150]}")
    return ("silent", "a lone surrogate went through")


# ============================================================ data: load_documents and limits

TOKENIZER = []


def tokenizer():
    if not TOKENIZER:
        TOKENIZER.append(corpus.train_bpe_tokenizer(["some text to learn a few merges from"] * 20, vocab_size=300))
    return TOKENIZER[0]


@case("data: load_documents", "files=[] (silently the KJV before)")
def _():
    return expect_error(lambda: corpus.load_documents(files=[]), "files")


@case("data: load_documents", "files='one.txt' (characters as files)")
def _():
    return expect_error(lambda: corpus.load_documents(files="one.txt"), "one.txt")


@case("data: load_documents", "dataset='plays' together with files")
def _():
    path = write(fresh("ld") / "a.txt", "a document")
    return expect_error(lambda: corpus.load_documents(dataset="plays", files=[path]), "not both")


for label, data in {"empty": b"", "only blank lines": b" \n\t\n", "only blank JSON texts": b'{"text": " "}\n'}.items():
    @case("data: load_documents", f"one file {label} among good ones")
    def _(data=data):
        folder = fresh("ld")
        good = write(folder / "good.txt", "a document")
        name = "bad.jsonl" if b"{" in data else "bad.txt"
        bad = write(folder / name, data)
        return expect_error(lambda: corpus.load_documents(files=[good, bad]), name)

for label, kwargs in {"max_blocks=-1": {"max_blocks": -1}, "max_blocks=0": {"max_blocks": 0},
                      "max_blocks=-100": {"max_blocks": -100}, "max_blocks=2.5": {"max_blocks": 2.5},
                      "max_blocks=True": {"max_blocks": True}, "max_blocks='3'": {"max_blocks": "3"},
                      "block_size=1": {"block_size": 1}, "block_size=0": {"block_size": 0},
                      "block_size=-8": {"block_size": -8}, "block_size=4.0": {"block_size": 4.0},
                      "block_size=True": {"block_size": True}, "block_size=None": {"block_size": None}}.items():
    @case("data: limits", f"pack_into_blocks {label}")
    def _(kwargs=kwargs, label=label):
        return expect_error(lambda: corpus.pack_into_blocks(tokenizer(), ["some text"] * 50,
                                                            **({"block_size": 4} | kwargs)), label.split("=")[0])


@case("data: limits", "pack_into_blocks with a None text")
def _():
    return expect_error(lambda: corpus.pack_into_blocks(tokenizer(), ["a", None], block_size=4), "texts[1]")


@case("data: limits", "pack_into_blocks with a tokenizer without EOS")
def _():
    tok = corpus.train_bpe_tokenizer(["abc"], vocab_size=300)
    tok.eos_token = None
    return expect_error(lambda: corpus.pack_into_blocks(tok, ["some text"] * 50, block_size=4), "eos")


@case("data: limits", "pack_into_blocks max_blocks=1 gives one block")
def _():
    return expect_value(lambda: len(corpus.pack_into_blocks(tokenizer(), ["some text"] * 50, 4, max_blocks=1)), 1)


for vocab in (0, -1, 100, 257, 300.0):
    case("data: limits", f"train_bpe_tokenizer vocab_size={vocab!r}")(
        lambda vocab=vocab: expect_error(lambda: corpus.train_bpe_tokenizer(["abc"], vocab_size=vocab), "vocab_size"))

for fraction in (0.0, 1.0, -0.5, float("nan"), 1.5):
    case("data: limits", f"split_documents fraction {fraction}")(
        lambda fraction=fraction: expect_error(lambda: corpus.split_documents(["a", "b", "c"], fraction),
                                               "validation_fraction"))


# ============================================================ data: few-shot samplers

def one_entity_pool(size: int):
    return [{"tokens": ["Ann"], "ner_tags": ["B-PER"]}] + [{"tokens": [f"w{i}"], "ner_tags": ["O"]}
                                                             for i in range(size - 1)]


for size, n in ((100, 10), (100, 50), (20, 2), (5, 1), (2, 1), (100, 99)):
    @case("data: few-shot samplers", f"one entity sentence in {size}, n={n}, 30 seeds")
    def _(size=size, n=n):
        pool = one_entity_pool(size)
        empty = [seed for seed in range(30) if not D.count_entities(D.sample_sentences(pool, n, seed))]
        return "ok" if not empty else ("silent", f"entity-free training set for seeds {empty[:8]}...")

SAMPLER_BAD = {
    "n=1.5": lambda pool: D.sample_sentences(pool, 1.5, 0), "n=True": lambda pool: D.sample_sentences(pool, True, 0),
    "n=0": lambda pool: D.sample_sentences(pool, 0, 0), "k=0": lambda pool: D.sample_kshot(pool, 0, 0),
    "k=1.0": lambda pool: D.sample_kshot(pool, 1.0, 0),
    "entity_types='PER'": lambda pool: D.sample_kshot(pool, 1, 0, entity_types="PER"),
    "entity_types=[]": lambda pool: D.sample_kshot(pool, 1, 0, entity_types=[]),
}
for label, call in SAMPLER_BAD.items():
    case("data: few-shot samplers", label)(lambda call=call, label=label: expect_error(
        lambda: call(one_entity_pool(5)), label.split("=")[0]))


@case("data: few-shot samplers", "an IOB1 pool (I- tags only) has mentions")
def _():
    pool = [{"tokens": ["Ann", "x"], "ner_tags": ["I-PER", "O"]}, {"tokens": ["y"], "ner_tags": ["O"]}]
    return expect_value(lambda: dict(D.count_entities(pool)), {"PER": 1})


# ============================================================ data: NER settings and configs

NER_BAD = {"sizes=[]": {"sizes": []}, "seeds=[]": {"seeds": []}, "fusions=[]": {"fusions": []},
           "batch_size=0": {"batch_size": 0}, "max_length=1": {"max_length": 1},
           "max_test_sentences=-1": {"max_test_sentences": -1}, "learning_rate=0": {"learning_rate": 0.0},
           "learning_rate=nan": {"learning_rate": float("nan")}, "warmup=-1": {"warmup": -1.0},
           "epochs=0 with max_steps=0": {"max_steps": 0, "epochs": 0.0}, "num_threads=-2": {"num_threads": -2},
           "dataset_config without dataset": {"dataset_config": "en"},
           "wnut_test_size=0": {"wnut_test_size": 0}, "seeds=[1.5]": {"seeds": [1.5]}}
for label, kwargs in NER_BAD.items():
    case("data: NER settings", label)(lambda kwargs=kwargs, label=label: expect_error(
        lambda: NER.NerSettings(**kwargs), label.split("=")[0].split(" ")[0]))


@case("data: NER settings", "dataset and train_file both")
def _():
    path = write(fresh("ner") / "t.conll", "a\tO\n")
    return expect_error(lambda: NER.NerSettings(dataset="conll2003", train_file=str(path), test_file=str(path)),
                        "dataset")


@case("data: NER settings", "a missing train_file is refused at construction")
def _():
    return expect_error(lambda: NER.NerSettings(train_file="/nope.conll", test_file="/nope.conll"), "nope.conll")


for label, data in {"trailing comma": b'{"max_steps": 1,}', "not JSON": b"max_steps=1", "array": b"[1]",
                    "latin-1": b'{"x": "\xe9"}', "UTF-16": codecs.BOM_UTF16_LE + '{}'.encode("utf-16-le"),
                    "empty": b""}.items():
    @case("data: NER settings", f"config file {label}")
    def _(data=data):
        path = write(fresh("ner") / "cfg.json", data)
        return expect_error(lambda: NER.read_config(path), "cfg.json")


@case("data: NER settings", "config file with a BOM and CRLF is read")
def _():
    path = write(fresh("ner") / "cfg.json", codecs.BOM_UTF8 + b'{\r\n "max_steps": 3\r\n}')
    return expect_value(lambda: NER.read_config(path), {"max_steps": 3})


# ============================================================ run

def main() -> None:
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    counts: dict[str, dict[str, int]] = {}
    def hung(*_):
        raise TimeoutError("the case ran for 180 s (a hang)")

    signal.signal(signal.SIGALRM, hung)
    for area, name, fn in CASES:
        if only and only not in area:
            continue
        signal.alarm(180)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                verdict = fn()
        except TimeoutError as error:
            verdict = ("hang", str(error))
        except BaseException as error:  # noqa: BLE001
            verdict = ("crash", f"probe: {type(error).__name__}: {str(error)[:200]} "
                                f"{traceback.format_exc().splitlines()[-3][:200]}")
        signal.alarm(0)
        kind, why = (verdict, "") if isinstance(verdict, str) else verdict
        counts.setdefault(area, {}).setdefault(kind, 0)
        counts[area][kind] += 1
        print(json.dumps({"area": area, "case": name, "verdict": kind, "why": why}), flush=True)
    total: dict[str, int] = {}
    for kinds in counts.values():
        for kind, n in kinds.items():
            total[kind] = total.get(kind, 0) + n
    print(json.dumps({"summary": counts, "total": total, "cases": sum(total.values())}))
    shutil.rmtree(ROOT, ignore_errors=True)


if __name__ == "__main__":
    main()
