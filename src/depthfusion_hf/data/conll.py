"""Read CoNLL-style NER files: one ``token<TAB or spaces>...<tag>`` line per token, blank lines between sentences.

A sentence is a dict ``{"tokens": [str, ...], "ner_tags": [str, ...]}`` with IOB2 tags. IOB1 input
(CoNLL-03's original files, where a chunk may start with ``I-``) is converted to IOB2; tags other than
``O``, ``B-<type>`` and ``I-<type>`` are errors, reported with the file name and line number.
"""

from __future__ import annotations

import re
from pathlib import Path

from .textfile import DataFormatError, read_text

_TAG = re.compile(r"^(O|[BI]-\S+)$")
_SPACES = re.compile(" +")


class ConllFormatError(DataFormatError):
    """A malformed line in a CoNLL/IOB file (or bytes that are not UTF-8); the message starts with ``path:line:``."""

    def __init__(self, path: str | Path, line: int, message: str):
        super().__init__(path, line, message)


def to_iob2(tags: list[str]) -> list[str]:
    """Convert IOB1 tags to IOB2: an ``I-X`` that does not continue an ``X`` chunk becomes ``B-X``.

    IOB2 input is returned unchanged (the conversion is idempotent).
    """
    out: list[str] = []
    previous = "O"
    for tag in tags:
        if tag.startswith("I-") and (previous == "O" or previous[2:] != tag[2:]):
            tag = "B-" + tag[2:]
        out.append(tag)
        previous = tag
    return out


def _columns(line: str) -> list[str]:
    """A line's columns: split on tabs when it has one, else on runs of ASCII spaces.

    Never on other whitespace: a token may hold a no-break space, a thin space, an ideographic space...
    (``str.split()`` would cut it in two). Spaces around a column and tabs at the end of the line are not part
    of any column (a tab at the start leaves an empty first column).
    """
    line = line.rstrip(" \t")
    columns = line.split("\t") if "\t" in line else _SPACES.split(line.lstrip(" "))
    return [column.strip(" ") for column in columns]


def read_conll(path: str | Path, token_column: int = 0, tag_column: int = -1) -> list[dict[str, list[str]]]:
    """Read sentences from a CoNLL/IOB file.

    Columns are split on tabs when the line has one, else on runs of ASCII spaces (never on other
    whitespace: a token holding a no-break space stays one token); the token is column ``token_column``
    and the tag column ``tag_column`` (default: first and last, which fits both the two-column WNUT format
    and CoNLL-03's four columns). A line holding only whitespace (of any kind) ends a sentence.
    ``-DOCSTART-`` lines are skipped. The file is UTF-8, with or without a byte-order mark, with Unix or
    Windows line ends (see ``read_text``).

    Raises:
        FileNotFoundError / IsADirectoryError: the path is missing or a folder (named as such).
        ValueError: ``token_column`` and ``tag_column`` are not integers or name the same column.
        ConllFormatError: bytes that are not UTF-8, a line with fewer than two columns or without the columns
            asked for, an empty token, or a tag that is not ``O`` / ``B-<type>`` / ``I-<type>``; the message
            names the file and the 1-based line.
    """
    for name, value in (("token_column", token_column), ("tag_column", tag_column)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer column index; got {value!r}")
    path = Path(path)
    sentences: list[dict[str, list[str]]] = []
    tokens: list[str] = []
    tags: list[str] = []

    def flush() -> None:
        if tokens:
            sentences.append({"tokens": list(tokens), "ner_tags": to_iob2(tags)})
            tokens.clear()
            tags.clear()

    try:
        text = read_text(path)
    except DataFormatError as error:
        raise ConllFormatError(path, error.line, error.reason) from error
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            flush()
            continue
        columns = _columns(line)
        if columns[0].startswith("-DOCSTART-"):
            flush()
            continue
        if len(columns) < 2:
            raise ConllFormatError(path, number, f"expected a token and a tag separated by a tab, got {line!r}")
        try:
            token, tag = columns[token_column], columns[tag_column]
        except IndexError:
            raise ConllFormatError(path, number, f"the line has {len(columns)} columns; token_column={token_column} "
                                   f"and tag_column={tag_column} do not both exist in {line!r}") from None
        if token_column % len(columns) == tag_column % len(columns):
            raise ValueError(f"token_column={token_column} and tag_column={tag_column} are the same column of "
                             f"{path}:{number}")
        if not token:
            raise ConllFormatError(path, number, f"empty token in {line!r}")
        if not _TAG.match(tag):
            raise ConllFormatError(path, number, f"invalid tag {tag!r}; expected 'O', 'B-<type>' or 'I-<type>'")
        tokens.append(token)
        tags.append(tag)
    flush()
    return sentences


__all__ = ["ConllFormatError", "read_conll", "to_iob2"]
