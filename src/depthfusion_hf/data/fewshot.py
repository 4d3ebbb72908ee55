"""Seeded few-shot samplers: N random sentences, or K shots per entity type (greedy, Yang & Katiyar 2020)."""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass

Sentence = dict[str, list[str]]


@dataclass(frozen=True)
class TrainingSize:
    """A training-set size: ``kind`` is ``"sentences"`` (N random sentences) or ``"kshot"`` (K per entity type)."""

    kind: str
    value: int

    @property
    def label(self) -> str:
        """``"50"`` for 50 sentences, ``"5-shot"`` for K = 5."""
        return str(self.value) if self.kind == "sentences" else f"{self.value}-shot"


def parse_size(spec: str | int) -> TrainingSize:
    """Parse ``"50"`` / ``50`` (sentences) or ``"5shot"`` / ``"5-shot"`` (K shots per entity type).

    Raises ValueError for anything else, or for a value < 1.
    """
    text = str(spec).strip().lower()
    match = re.fullmatch(r"(\d+)(-?shot)?", text)
    if match is None or int(match.group(1)) < 1:
        raise ValueError(f"training size must be a positive integer N or 'K-shot' (e.g. 50, 5-shot); got {spec!r}")
    return TrainingSize("kshot" if match.group(2) else "sentences", int(match.group(1)))


def count_entities(sentences: list[Sentence]) -> Counter:
    """Entity mentions per type over ``sentences``: one per chunk start, i.e. a ``B-X`` tag, or an ``I-X`` tag that
    does not continue an ``X`` chunk (IOB1 input counts as its IOB2 conversion would)."""
    counts: Counter = Counter()
    for sentence in sentences:
        previous = "O"
        for tag in sentence["ner_tags"]:
            if tag.startswith("B-") or (tag.startswith("I-") and previous[2:] != tag[2:]):
                counts[tag[2:]] += 1
            previous = tag
    return counts


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    return value


def check_pool(sentences: list[Sentence]) -> None:
    """Raise a ValueError unless ``sentences`` holds at least one entity mention to learn from.

    An empty pool (an empty or all-blank training file) or one whose tags are all ``O`` would hand the
    Trainer a training set with nothing to learn; the samplers refuse both, saying which it is.
    """
    if not sentences:
        raise ValueError("the training pool is empty: no sentence was read (is the training file empty?)")
    if not count_entities(sentences):
        raise ValueError(
            f"the training pool of {len(sentences)} sentences has no entity mention (every tag is 'O'): "
            "no few-shot training set can be drawn from it"
        )


def sample_sentences(sentences: list[Sentence], n: int, seed: int) -> list[Sentence]:
    """``n`` distinct sentences drawn uniformly with ``random.Random(seed)`` (same seed, same sample), never an
    entity-free set.

    When the uniform draw holds no entity mention (a pool with few entity sentences), its last sentence is
    replaced by an entity sentence drawn with the same generator, so the set still has ``n`` distinct sentences
    and at least one mention; a draw that already holds one is kept as drawn.

    Raises ValueError for a pool that is empty or has no entity mention (:func:`check_pool`), or ``n``
    outside ``[1, len(sentences)]``.
    """
    _count("n", n)
    check_pool(sentences)
    if not 1 <= n <= len(sentences):
        raise ValueError(f"cannot sample n={n} sentences from a pool of {len(sentences)}")
    rng = random.Random(seed)
    chosen = rng.sample(range(len(sentences)), n)
    if not count_entities([sentences[i] for i in chosen]):
        with_entities = [i for i, sentence in enumerate(sentences) if count_entities([sentence])]
        chosen[-1] = rng.choice(with_entities)  # none of them was drawn, so the set stays distinct
    return [sentences[i] for i in chosen]


def sample_kshot(sentences: list[Sentence], k: int, seed: int, entity_types: list[str] | None = None) -> list[Sentence]:
    """A K-shot support set: every entity type has at least ``k`` mentions, and no sentence is redundant.

    Greedy sampling of Yang & Katiyar (2020): visit the sentences in a ``random.Random(seed)`` order and
    keep one when it mentions a type that still has fewer than ``k`` mentions; then drop every kept
    sentence whose removal leaves all types at ``>= k``. Sentences without entities are never chosen.
    ``entity_types`` defaults to all types in ``sentences``.

    Raises ValueError for a pool that is empty or has no entity mention (:func:`check_pool`), a ``k`` that is not
    an integer >= 1, an empty ``entity_types`` (or a single string), or a pool with fewer than ``k`` mentions of
    some type.
    """
    if _count("k", k) < 1:
        raise ValueError(f"k must be >= 1; got {k}")
    check_pool(sentences)
    if isinstance(entity_types, str):
        raise ValueError(f"entity_types must be a list of type names; got the string {entity_types!r} "
                         f"(write [{entity_types!r}])")
    types = sorted(set(entity_types) if entity_types is not None else count_entities(sentences))
    if not types:
        raise ValueError("entity_types is empty: a K-shot set needs at least one entity type")
    available = count_entities(sentences)
    short = [t for t in types if available[t] < k]
    if short:
        raise ValueError(f"the pool has fewer than k={k} mentions of {short}")
    order = list(range(len(sentences)))
    random.Random(seed).shuffle(order)
    counts: Counter = Counter()
    chosen: list[int] = []
    for index in order:
        mentions = count_entities([sentences[index]])
        if any(counts[t] < k for t in mentions if t in types):
            chosen.append(index)
            counts.update(mentions)
            if all(counts[t] >= k for t in types):
                break
    for index in list(chosen):  # removal pass: drop sentences the others make redundant
        mentions = count_entities([sentences[index]])
        if all(counts[t] - mentions[t] >= k for t in types):
            chosen.remove(index)
            counts.subtract(mentions)
    return [sentences[i] for i in chosen]


__all__ = ["TrainingSize", "check_pool", "count_entities", "parse_size", "sample_kshot", "sample_sentences"]
