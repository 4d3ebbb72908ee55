"""Data: CoNLL reader (and its file:line errors), samplers, label alignment, WNUT-16 split, Hub conversion."""

from collections import Counter

import pytest
from datasets import ClassLabel, Dataset, Features, List, Value

from depthfusion_hf.data import (
    ConllFormatError,
    align_first_subword,
    build_label_list,
    count_entities,
    load_wnut16,
    parse_size,
    read_conll,
    sample_kshot,
    sample_sentences,
    sentences_from_hf_split,
    to_iob2,
    tokenize_and_align,
    word_predictions,
)

from .helpers import LABEL2ID, tiny_tokenizer


def write(tmp_path, text: str, name: str = "data.conll"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_reader_handles_tabs_columns_docstart_and_blank_lines(tmp_path):
    path = write(tmp_path, "-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\t\n"
                           "John\tB-PER\nSmith\tI-PER\n\n\n")
    assert read_conll(path) == [
        {"tokens": ["EU", "rejects"], "ner_tags": ["B-ORG", "O"]},
        {"tokens": ["John", "Smith"], "ner_tags": ["B-PER", "I-PER"]},
    ]


def test_reader_converts_iob1_to_iob2(tmp_path):
    path = write(tmp_path, "Peter I-PER\nBlack I-PER\nand O\nParis I-LOC\nLondon B-LOC\n")
    assert read_conll(path)[0]["ner_tags"] == ["B-PER", "I-PER", "O", "B-LOC", "B-LOC"]
    assert to_iob2(["B-X", "I-X", "I-Y", "O", "I-X"]) == ["B-X", "I-X", "B-Y", "O", "B-X"]


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("John\tB-PER\nSmith\n", 2, "expected a token and a tag"),
        ("John\tB-PER\n\nParis\tLOC\n", 3, "invalid tag 'LOC'"),
        ("a O\nb O\nc O\nd X-PER\n", 4, "invalid tag"),
        ("a\tO\n\tB-PER\n", 2, "empty token"),
    ],
)
def test_reader_errors_name_the_file_and_line(tmp_path, text, line, message):
    path = write(tmp_path, text, name="broken.txt")
    with pytest.raises(ConllFormatError, match=message) as info:
        read_conll(path)
    assert str(info.value).startswith(f"{path}:{line}: ")
    assert (info.value.path, info.value.line) == (str(path), line)
    assert isinstance(info.value, ValueError)


def pool(n: int = 60) -> list[dict]:
    """Synthetic sentences: every 3rd has a PER, every 4th a LOC, every 10th a rare ORG, the rest none."""
    sentences = []
    for i in range(n):
        tokens, tags = [f"w{i}"], ["O"]
        if i % 3 == 0:
            tokens, tags = tokens + ["ann", "lee"], tags + ["B-PER", "I-PER"]
        if i % 4 == 0:
            tokens, tags = tokens + ["paris"], tags + ["B-LOC"]
        if i % 10 == 0:
            tokens, tags = tokens + ["acme"], tags + ["B-ORG"]
        sentences.append({"tokens": tokens, "ner_tags": tags})
    return sentences


def test_sentence_sampler_is_seeded_and_distinct():
    data = pool()
    first = sample_sentences(data, 10, seed=3)
    assert first == sample_sentences(data, 10, seed=3)
    assert first != sample_sentences(data, 10, seed=4)
    assert len({s["tokens"][0] for s in first}) == 10
    with pytest.raises(ValueError, match="n=61"):
        sample_sentences(data, 61, seed=0)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_kshot_sampler_gives_every_type_k_mentions_with_no_redundant_sentence(k):
    data = pool()
    support = sample_kshot(data, k, seed=7)
    counts = count_entities(support)
    assert set(counts) == {"PER", "LOC", "ORG"}
    assert all(counts[t] >= k for t in counts)
    for i in range(len(support)):  # minimal: dropping any sentence leaves some type short
        rest = count_entities(support[:i] + support[i + 1 :])
        assert any(rest[t] < k for t in counts)
    assert all(any(tag != "O" for tag in s["ner_tags"]) for s in support)
    assert support == sample_kshot(data, k, seed=7)


def test_kshot_sampler_differs_across_seeds_and_rejects_impossible_k():
    data = pool()
    first, second = sample_kshot(data, 2, seed=1), sample_kshot(data, 2, seed=2)
    assert {tuple(s["tokens"]) for s in first} != {tuple(s["tokens"]) for s in second}
    with pytest.raises(ValueError, match="ORG"):
        sample_kshot(data, 7, seed=0)  # only 6 ORG mentions


def test_parse_size():
    assert parse_size("50").kind == "sentences" and parse_size(50).value == 50
    assert parse_size("5-shot").kind == "kshot" and parse_size("5shot").value == 5
    assert parse_size("10-shot").label == "10-shot" and parse_size("20").label == "20"
    for bad in ("0", "five", "5-shots", "-3"):
        with pytest.raises(ValueError, match="training size"):
            parse_size(bad)


def test_first_subword_alignment_with_word_ids(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    batch = {"tokens": [["John", "visited", "Yorkers", "today"]], "ner_tags": [["B-PER", "O", "B-LOC", "O"]]}
    encoding = tokenize_and_align(batch, tokenizer, LABEL2ID)
    tokens = encoding.tokens(0)
    assert tokens == ["[CLS]", "john", "visited", "york", "##er", "##s", "today", "[SEP]"]
    assert encoding["labels"][0] == [-100, 1, 0, 3, -100, -100, 0, -100]
    assert align_first_subword([None, 0, 0, 1, None], [4, 2]) == [-100, 4, -100, 2, -100]


def test_word_predictions_invert_the_alignment_and_fill_missing_words_with_o(tmp_path):
    id2label = {i: label for label, i in LABEL2ID.items()}
    word_ids = [None, 0, 1, 1, 1, None]  # word 2 was cut by truncation
    predicted = [0, 1, 3, 4, 4, 0]
    assert word_predictions(word_ids, predicted, 3, id2label) == ["B-PER", "B-LOC", "O"]


def test_build_label_list_orders_o_then_b_i_per_type():
    data = [{"tokens": ["a", "b"], "ner_tags": ["B-PER", "I-LOC"]}]
    assert build_label_list(data, [{"tokens": ["c"], "ner_tags": ["B-ORG"]}]) == [
        "O", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "B-PER", "I-PER"]


def test_wnut16_split_is_fixed_disjoint_and_complete():
    splits = load_wnut16(test_size=600, validation_size=100)
    assert (len(splits["test"]), len(splits["validation"]), len(splits["train"])) == (600, 100, 1694)
    again = load_wnut16(test_size=600, validation_size=0)
    assert again["test"] == splits["test"]
    keys = [tuple(s["tokens"]) for split in splits.values() for s in split]
    assert len(keys) == 2394
    counts = count_entities(splits["train"])
    assert len(counts) == 10 and counts["person"] > 100
    with pytest.raises(ValueError, match="test_size"):
        load_wnut16(test_size=2394)


def test_hub_split_conversion_maps_class_labels_to_iob2_strings():
    names = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    features = Features({"tokens": List(Value("string")), "ner_tags": List(ClassLabel(names=names))})
    split = Dataset.from_dict({"tokens": [["Ann", "Lee", "in", "Rome"]], "ner_tags": [[1, 2, 0, 4]]}, features=features)
    assert sentences_from_hf_split(split) == [{"tokens": ["Ann", "Lee", "in", "Rome"],
                                               "ner_tags": ["B-PER", "I-PER", "O", "B-LOC"]}]
    assert Counter(count_entities(sentences_from_hf_split(split))) == {"PER": 1, "LOC": 1}
