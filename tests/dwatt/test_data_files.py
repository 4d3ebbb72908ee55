"""Real-world data files: JSON/JSONL with null or non-string texts, byte-order marks, Windows line ends, latin-1
bytes, broken JSON, and CoNLL files with the same; few-shot pools that hold nothing to learn. Each is read
right or rejected with the file name and line."""

from __future__ import annotations

import codecs

import pytest

from depthfusion_hf.data import (
    ConllFormatError,
    DataFormatError,
    read_conll,
    read_json_documents,
    read_text,
    read_text_documents,
    sample_kshot,
    sample_sentences,
)
from depthfusion_hf.data.corpus import load_documents

BOM = codecs.BOM_UTF8


def write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


BAD_JSONL = [
    pytest.param(b'{"text": "a"}\n{"text": null}\n', 2, "must be a string; got NoneType", id="null-text"),
    pytest.param(b'{"text": "a"}\n\n{"text": 5}\n', 3, "must be a string; got int", id="number-text"),
    pytest.param(b'{"text": ["a", "b"]}\n', 1, "must be a string; got list", id="list-text"),
    pytest.param(b'{"text": "a"}\n{"body": "b"}\n', 2, "has no 'text' field", id="missing-field"),
    pytest.param(b'"just a string"\n', 1, "is a JSON string, not an object with a 'text' field", id="not-an-object"),
    pytest.param(b'{"text": "a"}\n{"text": \n', 2, "invalid JSON", id="broken-json"),
    pytest.param(b'{"text": "caf\xe9"}\n', 1, r"not valid UTF-8 \(byte 0xe9 at column 14\)", id="latin-1"),
    pytest.param(b'{"text": "a"}\r\n{"text": "caf\xe9"}\r\n', 2, "not valid UTF-8", id="latin-1-crlf"),
]


@pytest.mark.parametrize(("data", "line", "message"), BAD_JSONL)
def test_bad_jsonl_rows_are_rejected_naming_file_and_line(tmp_path, data, line, message):
    path = write(tmp_path, "corpus.jsonl", data)
    with pytest.raises(DataFormatError, match=message) as info:
        read_json_documents(path)
    assert str(info.value).startswith(f"{path}:{line}: ")
    assert (info.value.path, info.value.line) == (str(path), line)
    with pytest.raises(DataFormatError):  # the CLI entry point gives the same error, never a "None" document
        load_documents(files=[path])


BAD_JSON_ARRAYS = [
    pytest.param(b'[{"text": "a"}, {"text": null}]', "record 2: the 'text' field must be a string", id="null-text"),
    pytest.param(b'[{"text": "a"},\n {"text": 1.5}]', "record 2: the 'text' field must be a string; got float",
                 id="number-text"),
    pytest.param(b'[{"text": "a"},\n {"text": ]', "invalid JSON", id="broken-json"),
]


@pytest.mark.parametrize(("data", "message"), BAD_JSON_ARRAYS)
def test_bad_json_arrays_are_rejected_naming_the_file(tmp_path, data, message):
    path = write(tmp_path, "corpus.json", data)
    with pytest.raises(DataFormatError, match=message) as info:
        read_json_documents(path)
    assert str(info.value).startswith(f"{path}:")


def test_jsonl_with_bom_and_windows_line_ends_is_read_right(tmp_path):
    path = write(tmp_path, "corpus.jsonl", BOM + '{"text": "café"}\r\n{"text": "  "}\r\n\r\n{"text": "b\\r\\nc"}\r\n'
                 .encode())
    assert read_json_documents(path) == ["café", "b\r\nc"]  # blank texts skipped; escaped CR LF kept as written


def test_json_array_with_bom_and_a_custom_column_is_read_right(tmp_path):
    path = write(tmp_path, "corpus.json", BOM + b'[\r\n {"body": "one"},\r\n {"body": "two"}\r\n]\r\n')
    assert read_json_documents(path, text_column="body") == ["one", "two"]


def test_text_file_with_bom_and_windows_line_ends_is_split_into_paragraphs(tmp_path):
    path = write(tmp_path, "corpus.txt", BOM + b"First line\r\nstill first.\r\n\r\nSecond.\r\n\r\n\r\nThird.\r\n")
    assert read_text_documents(path) == ["First line\nstill first.", "Second.", "Third."]
    old_mac = write(tmp_path, "mac.txt", b"One.\r\rTwo.\r")
    assert read_text_documents(old_mac) == ["One.", "Two."]


def test_latin_1_text_file_is_rejected_at_its_line(tmp_path):
    path = write(tmp_path, "corpus.txt", b"fine\n\nalso fine\nna\xefve\n")
    with pytest.raises(DataFormatError, match=r"corpus.txt:4: not valid UTF-8 \(byte 0xef at column 3\)"):
        read_text_documents(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        read_text(tmp_path / "nope.txt")


def test_conll_with_bom_and_windows_line_ends_is_read_right(tmp_path):
    path = write(tmp_path, "train.conll", BOM + b"-DOCSTART- O\r\n\r\nJohn\tB-PER\r\nlives\tO\r\n\r\nParis\tB-LOC\r\n")
    assert read_conll(path) == [{"tokens": ["John", "lives"], "ner_tags": ["B-PER", "O"]},
                                {"tokens": ["Paris"], "ner_tags": ["B-LOC"]}]


def test_conll_with_latin_1_bytes_is_rejected_at_its_line(tmp_path):
    path = write(tmp_path, "train.conll", b"John\tB-PER\r\n\r\nM\xfcnchen\tB-LOC\r\n")
    with pytest.raises(ConllFormatError, match="not valid UTF-8") as info:
        read_conll(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert (info.value.path, info.value.line) == (str(path), 3)


ALL_O = [{"tokens": ["a", "b"], "ner_tags": ["O", "O"]}, {"tokens": ["c"], "ner_tags": ["O"]}]


@pytest.mark.parametrize("sample", [lambda pool: sample_sentences(pool, 1, seed=0),
                                    lambda pool: sample_kshot(pool, 1, seed=0)], ids=["sentences", "kshot"])
@pytest.mark.parametrize(("pool", "message"), [([], "the training pool is empty"),
                                               (ALL_O, "has no entity mention")], ids=["empty", "all-O"])
def test_samplers_refuse_a_pool_with_nothing_to_learn(sample, pool, message):
    with pytest.raises(ValueError, match=message):
        sample(pool)


def test_an_empty_training_file_gives_the_empty_pool_error(tmp_path):
    pool = read_conll(write(tmp_path, "train.conll", b"\r\n\r\n"))
    assert pool == []
    with pytest.raises(ValueError, match="training pool is empty"):
        sample_kshot(pool, 5, seed=0)


def test_kshot_refuses_an_empty_entity_type_list():
    pool = [{"tokens": ["Ann"], "ner_tags": ["B-PER"]}]
    with pytest.raises(ValueError, match="entity_types is empty"):
        sample_kshot(pool, 1, seed=0, entity_types=[])


def test_a_dataset_folder_with_numeric_texts_is_rejected_naming_the_row(tmp_path):
    # load_dataset's own route (a folder instead of a Hub id; tests/conftest.py gives it a private HF_HOME)
    folder = tmp_path / "dataset"
    folder.mkdir()
    write(folder, "train.jsonl", b'{"text": 1}\n{"text": 2}\n')
    with pytest.raises(ValueError, match=r"column 'text' must hold strings; row 0 holds int \(1\)"):
        load_documents(dataset=str(folder))
    write(folder, "train.jsonl", b'{"text": "kept"}\n{"text": null}\n{"text": " "}\n')
    assert load_documents(dataset=str(folder)) == ["kept"]
