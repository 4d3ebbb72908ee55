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


def read_conll(path: str | Path, token_column: int = 0, tag_column: int = -1) -> list[dict[str, list[str]]]:
    """Read sentences from a CoNLL/IOB file.

    Columns are split on tabs when the line has one, else on whitespace; the token is column
    ``token_column`` and the tag column ``tag_column`` (default: first and last, which fits both the
    two-column WNUT format and CoNLL-03's four columns). ``-DOCSTART-`` lines are skipped. The file is
    UTF-8, with or without a byte-order mark, with Unix or Windows line ends (see ``read_text``).

    Raises:
        FileNotFoundError: the file does not exist.
        ConllFormatError: bytes that are not UTF-8, a line with fewer than two columns, an empty token, or
            a tag that is not ``O`` / ``B-<type>`` / ``I-<type>``; the message names the file and the 1-based line.
    """
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
        columns = line.split("\t") if "\t" in line else line.split()
        if columns[0].startswith("-DOCSTART-"):
            flush()
            continue
        if len(columns) < 2:
            raise ConllFormatError(path, number, f"expected a token and a tag separated by a tab, got {line!r}")
        token, tag = columns[token_column].strip(), columns[tag_column].strip()
        if not token:
            raise ConllFormatError(path, number, f"empty token in {line!r}")
        if not _TAG.match(tag):
            raise ConllFormatError(path, number, f"invalid tag {tag!r}; expected 'O', 'B-<type>' or 'I-<type>'")
        tokens.append(token)
        tags.append(tag)
    flush()
    return sentences


__all__ = ["ConllFormatError", "read_conll", "to_iob2"]
