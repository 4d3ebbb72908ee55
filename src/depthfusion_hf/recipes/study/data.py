"""A study's corpus, cut once: one tokenizer and the packed train / validation (/ test) blocks every run shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class StudyData:
    """A study's corpus, cut once: the tokenizer and the packed blocks every run of the study shares.

    Attributes:
        tokenizer: the byte-level BPE trained on the training documents.
        train: ``datasets.Dataset`` of training blocks (``input_ids``, ``labels``: [block_size]).
        validation: blocks of the validation documents (model and hyperparameter choices are made on these).
        test: blocks of the test documents, or ``None`` when the study carves no test split.
        info: the description stored with every run (document and block counts).
    """

    tokenizer: Any
    train: Any
    validation: Any
    test: Any
    info: dict


def prepare_study_data(
    dataset: str = "kjv",
    files: Sequence[str] | None = None,
    held_out_fraction: float = 0.03,
    vocab_size: int = 2048,
    block_size: int = 128,
    max_train_blocks: int | None = None,
    max_eval_blocks: int | None = 64,
    carve_test: bool = False,
    tokenizer: Any = None,
    dataset_config: str | None = None,
    text_column: str = "text",
) -> StudyData:
    """Load a corpus (``load_documents``: ``kjv``, ``plays``, a Hub id, or local ``files``), hold out its last
    ``held_out_fraction`` of documents, train the tokenizer on the rest and pack blocks.

    With ``carve_test`` the held-out documents are split in two contiguous halves: validation (first) and test
    (second); choices are made on validation, the test split is only reported. A given ``tokenizer`` (e.g. a
    pretrained checkpoint's) is used instead of training one. ``dataset_config`` and ``text_column`` are passed to
    ``load_documents`` (Hub datasets; ``text_column`` also names the field of JSON files).
    """
    from ...data.corpus import load_documents, pack_into_blocks, split_documents, train_bpe_tokenizer

    documents = load_documents(dataset, list(files) if files else None, text_column, dataset_config)
    train_docs, held_out = split_documents(documents, held_out_fraction)
    if carve_test:
        if len(held_out) < 2:
            raise ValueError(f"carving validation and test needs >= 2 held-out documents; got {len(held_out)} "
                             "(raise held_out_fraction)")
        val_docs, test_docs = held_out[: len(held_out) // 2], held_out[len(held_out) // 2:]
    else:
        val_docs, test_docs = held_out, None
    tokenizer = tokenizer if tokenizer is not None else train_bpe_tokenizer(train_docs, vocab_size)
    train = pack_into_blocks(tokenizer, train_docs, block_size, max_train_blocks)
    validation = pack_into_blocks(tokenizer, val_docs, block_size, max_eval_blocks)
    test = pack_into_blocks(tokenizer, test_docs, block_size, max_eval_blocks) if test_docs else None
    info = dict(documents=len(documents), train_documents=len(train_docs), validation_documents=len(val_docs),
                test_documents=len(test_docs) if test_docs else 0, train_blocks=len(train),
                validation_blocks=len(validation), test_blocks=len(test) if test is not None else 0)
    return StudyData(tokenizer, train, validation, test, info)



__all__ = ["StudyData", "prepare_study_data"]
