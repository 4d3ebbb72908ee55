"""Word-level NER tags <-> subword tokens: first-subword labelling with ``word_ids()``, and the way back."""

from __future__ import annotations

from transformers import BatchEncoding, PreTrainedTokenizerBase

IGNORE_INDEX = -100  # label of positions the loss skips: special tokens and non-first subwords


def build_label_list(*splits: list[dict[str, list[str]]]) -> list[str]:
    """``["O", "B-t1", "I-t1", "B-t2", ...]`` over the entity types found in any of ``splits`` (types sorted)."""
    types = sorted({tag[2:] for split in splits for sentence in split for tag in sentence["ner_tags"] if tag != "O"})
    return ["O"] + [f"{prefix}-{name}" for name in types for prefix in ("B", "I")]


def align_first_subword(word_ids: list[int | None], word_labels: list[int]) -> list[int]:
    """Token labels [T] from word labels: a word's label on its first subword, ``-100`` elsewhere.

    ``word_ids`` is a fast tokenizer's ``word_ids(i)`` (``None`` for special tokens).
    """
    labels: list[int] = []
    previous = None
    for word in word_ids:
        labels.append(IGNORE_INDEX if word is None or word == previous else word_labels[word])
        previous = word
    return labels


def word_predictions(word_ids: list[int | None], token_predictions: list[int], num_words: int,
                     id2label: dict[int, str]) -> list[str]:
    """Word tags [num_words] from token predictions [T]: each word takes its first subword's prediction.

    Words without a subword (stripped by the tokenizer, or cut by truncation) get ``"O"``, so every
    gold word is scored.
    """
    tags = ["O"] * num_words
    previous = None
    for position, word in enumerate(word_ids):
        if word is not None and word != previous:
            tags[word] = id2label[int(token_predictions[position])]
        previous = word
    return tags


def tokenize_and_align(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, label2id: dict[str, int],
                       max_length: int = 128) -> BatchEncoding:
    """Tokenise a batch of pre-split sentences (``batch["tokens"]``) and add first-subword ``labels``.

    For ``datasets.Dataset.map(..., batched=True)``; needs a fast tokenizer (``word_ids()``).
    Returns the encoding with ``input_ids``, ``attention_mask`` (…) and ``labels``, each [N][T_i].
    """
    encoding = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
    encoding["labels"] = [
        align_first_subword(encoding.word_ids(i), [label2id[tag] for tag in tags])
        for i, tags in enumerate(batch["ner_tags"])
    ]
    return encoding


__all__ = ["IGNORE_INDEX", "align_first_subword", "build_label_list", "tokenize_and_align", "word_predictions"]
