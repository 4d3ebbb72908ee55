"""Read a local text file as users have them: UTF-8 with or without a byte-order mark, Unix or Windows line ends.

Bytes that are not UTF-8 (a latin-1 or cp1252 file, say) are rejected with the file name and line rather
than guessed at: a wrong guess would silently change the text. Re-encode such a file first, e.g.
``iconv -f latin1 -t utf-8 in.txt > out.txt``.
"""

from __future__ import annotations

import codecs
from pathlib import Path


class DataFormatError(ValueError):
    """A data file that cannot be read right; the message starts with ``path:line:`` (or ``path:`` when the
    problem has no single line); ``path``, ``line`` and ``reason`` (the message without the place) hold the parts."""

    def __init__(self, path: str | Path, line: int | None, message: str):
        where = f"{path}:{line}:" if line is not None else f"{path}:"
        super().__init__(f"{where} {message}")
        self.path = str(path)
        self.line = line
        self.reason = message


def read_text(path: str | Path) -> str:
    """The file's text, decoded as UTF-8, a leading byte-order mark removed, line ends normalised to ``\\n``.

    Raises:
        FileNotFoundError: the file does not exist (the message names it).
        DataFormatError: the bytes are not UTF-8; names the file, the 1-based line and the offending byte.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    data = path.read_bytes()
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
    return text.replace("\r\n", "\n").replace("\r", "\n")


__all__ = ["DataFormatError", "read_text"]
