"""NER sets from the Hugging Face Hub (e.g. ``conll2003``, ``wikiann``), converted to string IOB2 sentences."""

from __future__ import annotations

from .conll import to_iob2


def sentences_from_hf_split(split, tokens_column: str = "tokens", tags_column: str = "ner_tags") -> list[dict]:
    """Turn a ``datasets.Dataset`` split into ``{"tokens", "ner_tags"}`` dicts with string IOB2 tags.

    Integer tags are mapped through the column's ``ClassLabel`` names; string tags are kept.
    """
    feature = split.features[tags_column]
    names = getattr(getattr(feature, "feature", None), "names", None)
    sentences = []
    for row in split:
        tags = [names[t] if names is not None and isinstance(t, int) else str(t) for t in row[tags_column]]
        sentences.append({"tokens": list(row[tokens_column]), "ner_tags": to_iob2(tags)})
    return sentences


def load_hub_ner(name: str, config_name: str | None = None) -> dict[str, list[dict]]:
    """Load every split of a Hub NER dataset with ``datasets.load_dataset`` (needs network or a cache)."""
    from datasets import load_dataset

    dataset = load_dataset(name, config_name)
    return {split: sentences_from_hf_split(dataset[split]) for split in dataset}


__all__ = ["load_hub_ner", "sentences_from_hf_split"]
