"""Documents from local files: ``.txt`` / ``.md`` paragraphs and ``.json`` / ``.jsonl`` records.

Text files: a document is a paragraph, and paragraphs are separated by blank lines, where a blank line may
hold any whitespace (spaces, tabs, no-break spaces, the other Unicode spaces, form feeds) and invisible
format characters (zero-width spaces and joiners, byte-order marks); U+2029 PARAGRAPH SEPARATOR is a
paragraph break by itself, and U+2028 LINE SEPARATOR and NEL (U+0085) end lines as ``\\n`` does.

JSON files: a JSON array of records, JSON Lines (one record per line), or a single record (one JSON object,
pretty-printed or not). A record is an object whose text field (``text_column``) is a string; a blank text
is skipped (no document). Everything else is a :class:`~depthfusion_hf.data.textfile.DataFormatError`
naming the file and the line, and saying which of the three forms was expected.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .textfile import DataFormatError, read_text

# Characters a blank line may hold: every Unicode whitespace character except the line breaks, and the
# invisible format characters (zero-width space / non-joiner / joiner, word joiner, BOM, Mongolian vowel sep.).
_BLANK = r"(?:[^\S\n\u2028\x85\u2029]|[\u180e\u200b-\u200d\u2060\ufeff])"
_LINE_BREAK = r"[\n\u2028\x85]"
_PARAGRAPH_BREAK = re.compile(rf"{_LINE_BREAK}(?:{_BLANK}*{_LINE_BREAK})+|\u2029")
# The same characters, line breaks included, for str.strip (every whitespace character lies below U+3001).
_BLANK_CHARS = "".join(chr(c) for c in range(0x3001) if chr(c).isspace()) + "\u180e\u200b\u200c\u200d\u2060\ufeff"
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_FORMS = ("expected a JSON array of objects, JSON Lines (one object per line) or one JSON object, each with "
          "a {column!r} field (--text_column names another field)")


def is_blank(text: str) -> bool:
    """True when ``text`` holds nothing but whitespace, line breaks and invisible format characters."""
    return not text.strip(_BLANK_CHARS)


def split_paragraphs(text: str) -> list[str]:
    """The paragraphs of ``text`` (see the module docstring), each stripped of blank characters at its edges."""
    parts = (part.strip(_BLANK_CHARS) for part in _PARAGRAPH_BREAK.split(text))
    return [part for part in parts if part]


def read_text_documents(path: str | os.PathLike) -> list[str]:
    """Documents from a ``.txt`` / ``.md`` file: its paragraphs (see the module docstring), stripped.

    UTF-8 with or without a byte-order mark, Unix or Windows line ends (see :func:`read_text`).
    """
    return split_paragraphs(read_text(path))


def _json_text(path: Path, line: int | None, record: int, row: object, text_column: str) -> str | None:
    """The text of JSON record number ``record`` (on ``line`` for JSONL), ``None`` for a blank one;
    DataFormatError for anything else."""
    if not isinstance(row, dict):
        raise DataFormatError(path, line, f"record {record} is a JSON {_kind(row)}, not an object with a "
                              f"{text_column!r} field; " + _FORMS.format(column=text_column))
    if text_column not in row:
        raise DataFormatError(path, line, f"record {record} has no {text_column!r} field (its fields: "
                              f"{sorted(row)[:10]}; use --text_column)")
    text = row[text_column]
    if not isinstance(text, str):
        raise DataFormatError(
            path, line,
            f"record {record}: the {text_column!r} field must be a string; got {type(text).__name__} ({text!r:.40})",
        )
    surrogate = _SURROGATE.search(text)
    if surrogate is not None:
        raise DataFormatError(path, line, f"record {record}: the {text_column!r} field holds an unpaired surrogate "
                              f"\\u{ord(surrogate.group()):04x} (a broken \\u escape), which is no character")
    return None if is_blank(text) else text


def _kind(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def read_json_documents(path: str | os.PathLike, text_column: str = "text") -> list[str]:
    """Documents from a ``.json`` / ``.jsonl`` file: a JSON array of records, JSON Lines, or one JSON object.

    Each record's ``text_column`` field is one document. Records whose text is blank are skipped (they are no
    document); a record that is not an object, lacks the field, or has a field that is not a string (``null``,
    a number, a list) is an error, never a ``"None"`` document.

    Raises:
        DataFormatError: bad UTF-8, invalid JSON, a bad record, or a JSON value of another form; names the file
            and the line (JSON Lines, or the parse error's line) or the record number (a JSON array).
    """
    path = Path(path)
    text = read_text(path)
    if is_blank(text):
        return []
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as error:
        first = next(line for line in text.split("\n") if not is_blank(line))
        if not _parses(first):  # one multi-line JSON document (pretty-printed) with an error inside
            raise DataFormatError(path, error.lineno, f"invalid JSON: {error.msg} (column {error.colno})") from error
        return _json_lines(path, text, text_column)
    if isinstance(whole, list):
        texts = (_json_text(path, None, n, row, text_column) for n, row in enumerate(whole, start=1))
        return [t for t in texts if t is not None]
    if isinstance(whole, dict) and text_column not in whole:
        raise DataFormatError(path, None, f"holds one JSON object without a {text_column!r} field (its fields: "
                              f"{sorted(whole)[:10]}); " + _FORMS.format(column=text_column))
    document = _json_text(path, 1, 1, whole, text_column)  # one record (a string or a number is refused)
    return [] if document is None else [document]


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _json_lines(path: Path, text: str, text_column: str) -> list[str]:
    documents = []
    record = 0
    for number, line in enumerate(text.split("\n"), start=1):
        if is_blank(line):
            continue
        record += 1
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataFormatError(path, number, f"invalid JSON: {error.msg} (column {error.colno})") from error
        document = _json_text(path, number, record, row, text_column)
        if document is not None:
            documents.append(document)
    return documents


TEXT_SUFFIXES = (".txt", ".md", "")
JSON_SUFFIXES = (".json", ".jsonl")


def read_local_file(path: str | os.PathLike, text_column: str = "text") -> list[str]:
    """The documents of one local file, by its suffix (``.json`` / ``.jsonl``: records; ``.txt`` / ``.md`` / none:
    paragraphs).

    Raises:
        ValueError: an unsupported suffix (naming the allowed ones).
        DataFormatError: a file that holds no document (empty, or only blank texts), and see the readers.
        FileNotFoundError / IsADirectoryError: not a file (see :func:`~depthfusion_hf.data.textfile.check_data_file`).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        documents = read_json_documents(path, text_column)
    elif suffix in TEXT_SUFFIXES:
        documents = read_text_documents(path)
    else:
        raise ValueError(f"{path}: unsupported data file type {suffix!r}; allowed: .txt, .md, .json, .jsonl "
                         "(or no suffix: text)")
    if not documents:
        raise DataFormatError(path, None, "holds no document (it is empty, or every text in it is blank)")
    return documents


__all__ = ["is_blank", "read_json_documents", "read_local_file", "read_text_documents", "split_paragraphs"]
