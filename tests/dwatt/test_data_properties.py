"""Data files read right by property (issue 19 §7): paragraphs split by any blank line, CoNLL tokens that hold
Unicode spaces, every JSON form, limits that would give nothing, few-shot sets that always hold an entity, and
paths that are not files. Each class is tested over generated cases, not only the reported one."""

from __future__ import annotations

import codecs
import json
import os
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from depthfusion_hf.data import (
    ConllFormatError,
    DataFormatError,
    count_entities,
    read_conll,
    read_json_documents,
    read_text,
    read_text_documents,
    sample_kshot,
    sample_sentences,
)
from depthfusion_hf.data.corpus import load_documents, pack_into_blocks, train_bpe_tokenizer

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

# Every Unicode whitespace character that is no line break, and the invisible format characters.
BLANKS = [" ", "\t", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", "\xa0", "\u1680", *map(chr, range(0x2000, 0x200b)),
          "\u202f", "\u205f", "\u3000", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u180e"]
LINE_ENDS = ["\n", "\r\n", "\r", "\u2028", "\x85"]
# read_text's rule, as universal newlines and str.splitlines have it: a lone "\r" ends a line, and "\r" directly
# before "\n" belongs to that line end ("\r\n"; "\r\r\n", a file converted to Windows line ends twice, too).
# So a "\r" with nothing between it and a "\n" / "\r\n" after it is no blank line: the generator never writes one.
_ENDS_AFTER_LONE_CR = [end for end in LINE_ENDS if not end.lstrip("\r").startswith("\n")]
_VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x2FFF, blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc"),
                         blacklist_characters="\x85\u180e\u200b\u200c\u200d\u2060\ufeff")
_WORD = st.text(_VISIBLE, min_size=1, max_size=6)


def _write(tmp_path_factory, name: str, data: bytes):
    path = tmp_path_factory.mktemp("data") / name
    path.write_bytes(data)
    return path


@st.composite
def _line(draw) -> str:
    """A line with visible text, maybe holding Unicode spaces between words."""
    words = draw(st.lists(_WORD, min_size=1, max_size=4))
    return "".join(w + (draw(st.sampled_from(BLANKS)) if i < len(words) - 1 else "") for i, w in enumerate(words))


@st.composite
def _text_file(draw) -> tuple[str, list[str]]:
    """A text file of paragraphs separated by blank lines of any kind, and the paragraphs expected back."""
    paragraphs = draw(st.lists(st.lists(_line(), min_size=1, max_size=3), min_size=1, max_size=4))
    pieces, expected = [], []
    for number, lines in enumerate(paragraphs):
        ends = [draw(st.sampled_from(LINE_ENDS)) for _ in lines[1:]]
        body = lines[0] + "".join(end + line for end, line in zip(ends, lines[1:]))
        expected.append(body.replace("\r\n", "\n").replace("\r", "\n"))
        pieces.append(body)
        if number < len(paragraphs) - 1:
            if draw(st.booleans()):
                separator = draw(st.sampled_from(LINE_ENDS))
                for _ in range(draw(st.integers(1, 2))):
                    blank = "".join(draw(st.lists(st.sampled_from(BLANKS), max_size=3)))
                    merges = not blank and separator.endswith("\r")
                    separator += blank + draw(st.sampled_from(_ENDS_AFTER_LONE_CR if merges else LINE_ENDS))
            else:
                separator = "\u2029"  # PARAGRAPH SEPARATOR alone
            pieces.append(separator)
    return "".join(pieces), expected


@PROPERTY
@given(case=_text_file(), bom=st.booleans())
@example(case=("0\n0\r\n0", ["0\n0\n0"]), bom=False)  # CI's case: "\r\n" is one line end, no blank line
@example(case=("0\r\r0\r\r\n0", ["0", "0\n0"]), bom=True)  # two lone "\r" are a blank line; "\r\r\n" is not
def test_paragraphs_separated_by_any_blank_line_are_separate_documents(tmp_path_factory, case, bom):
    text, expected = case
    path = _write(tmp_path_factory, "corpus.txt", (codecs.BOM_UTF8 if bom else b"") + text.encode())
    assert read_text_documents(path) == expected


def test_the_reported_whitespace_only_line_splits_documents(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("First paragraph.\n   \nSecond.\n\t\nThird.\n\xa0\nFourth.")
    assert read_text_documents(path) == ["First paragraph.", "Second.", "Third.", "Fourth."]


def test_a_file_converted_to_windows_line_ends_twice_keeps_its_paragraphs(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"line one\r\r\nline two\r\r\n\r\r\nnext paragraph\r\r\n")
    assert read_text_documents(path) == ["line one\nline two", "next paragraph"]


def test_a_byte_order_mark_of_a_joined_file_is_removed(tmp_path):
    path = tmp_path / "train.conll"
    path.write_bytes(codecs.BOM_UTF8 + b"John\tB-PER\n\n" + codecs.BOM_UTF8 + b"-DOCSTART- O\n\nParis\tB-LOC\n")
    assert read_conll(path) == [{"tokens": ["John"], "ner_tags": ["B-PER"]},
                                {"tokens": ["Paris"], "ner_tags": ["B-LOC"]}]


# -- CoNLL tokens ---------------------------------------------------------------------------------------------

_TOKEN_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x3100, blacklist_categories=("Cs",),
                             blacklist_characters="\n\r\t \x85\u2028\u2029\ufeff")
_TOKEN = st.text(_TOKEN_CHARS | st.sampled_from(BLANKS[2:-2]), min_size=1, max_size=5).filter(
    lambda t: not t.startswith("-DOCSTART-") and t.strip() == t.strip(" "))
_TAG = st.sampled_from(["O", "B-PER", "I-PER", "B-LOC", "B-misc"])


@PROPERTY
@given(sentences=st.lists(st.lists(st.tuples(_TOKEN, _TAG), min_size=1, max_size=4), min_size=1, max_size=3),
       separator=st.sampled_from(["\t", " ", "  ", " \t "]), end=st.sampled_from(["\n", "\r\n"]),
       blank=st.sampled_from(["", " ", "\t", "\xa0", "\u3000 "]))
def test_conll_tokens_holding_unicode_spaces_stay_one_token(tmp_path_factory, sentences, separator, end, blank):
    lines = []
    for sentence in sentences:
        lines += [f"{token}{separator}{tag}" for token, tag in sentence] + [blank]
    path = _write(tmp_path_factory, "train.conll", end.join(lines).encode())
    read = read_conll(path)
    assert [s["tokens"] for s in read] == [[token for token, _ in sentence] for sentence in sentences]
    assert [len(s["ner_tags"]) for s in read] == [len(sentence) for sentence in sentences]


def test_the_reported_no_break_space_token(tmp_path):
    path = tmp_path / "train.conll"
    path.write_text("New\xa0York B-LOC\nis O\n10\u202f000 O\n")
    assert read_conll(path)[0]["tokens"] == ["New\xa0York", "is", "10\u202f000"]


@pytest.mark.parametrize(("columns", "message"), [((0, 5), "columns"), ((0, 0), "same column"),
                                                  ((1.0, -1), "integer"), ((0, True), "integer")])
def test_impossible_conll_columns_are_refused_naming_them(tmp_path, columns, message):
    path = tmp_path / "train.conll"
    path.write_text("John NNP B-PER\n")
    with pytest.raises(ValueError, match=message):
        read_conll(path, *columns)


# -- JSON forms -----------------------------------------------------------------------------------------------

_DOC = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20).filter(
    lambda t: t.strip() and t.strip("\u180e\u200b\u200c\u200d\u2060\ufeff\u2028\u2029\x85"
                                    " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
                                    "\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000"))


@PROPERTY
@given(docs=st.lists(_DOC, min_size=1, max_size=4), form=st.sampled_from(["array", "array-indented", "jsonl",
                                                                          "object", "object-indented"]),
       bom=st.booleans(), crlf=st.booleans(), ascii_only=st.booleans())
def test_every_json_form_gives_its_documents(tmp_path_factory, docs, form, bom, crlf, ascii_only):
    records = [{"id": i, "text": doc} for i, doc in enumerate(docs)]
    if form.startswith("object"):
        records = records[:1]
    indent = 2 if form.endswith("indented") else None
    if form == "jsonl":
        text = "\n".join(json.dumps(r, ensure_ascii=ascii_only) for r in records) + "\n"
    elif form.startswith("array"):
        text = json.dumps(records, indent=indent, ensure_ascii=ascii_only)
    else:
        text = json.dumps(records[0], indent=indent, ensure_ascii=ascii_only)
    if crlf:
        text = text.replace("\n", "\r\n")
    path = _write(tmp_path_factory, "corpus.json", (codecs.BOM_UTF8 if bom else b"") + text.encode())
    assert read_json_documents(path) == [r["text"] for r in records]


def test_the_reported_pretty_printed_object_is_read(tmp_path):
    path = tmp_path / "corpus.json"
    path.write_text('{\n  "title": "one document",\n  "text": "All of it."\n}\n')
    assert read_json_documents(path) == ["All of it."]


@pytest.mark.parametrize(("text", "message"), [
    ('{\n  "title": "x",\n  "body": "y"\n}\n', r"one JSON object without a 'text' field \(its fields: \['body', "),
    ('{\n  "text": "a",\n  "text2": \n}\n', r":4: invalid JSON: Expecting value"),
    ('[\n  {"text": "a"},\n  {"text": "b"\n]\n', r":4: invalid JSON"),
    ('42\n', r"record 1 is a JSON number, not an object"),
    ('{"text": "\\ud800 broken escape"}\n', r"unpaired surrogate \\ud800"),
], ids=["object-without-field", "pretty-object-broken", "pretty-array-broken", "number", "lone-surrogate"])
def test_json_that_is_no_corpus_says_which_form_was_expected(tmp_path, text, message):
    path = tmp_path / "corpus.json"
    path.write_text(text)
    with pytest.raises(DataFormatError, match=message):
        read_json_documents(path)


# -- paths that are not files ----------------------------------------------------------------------------------


def _not_files(tmp_path):
    folder = tmp_path / "corpus.txt"
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "nowhere.txt")
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    return {"folder": (folder, IsADirectoryError, "is a folder, not a file"),
            "dangling": (dangling, FileNotFoundError, "symlink to nothing"),
            "fifo": (fifo, DataFormatError, "not a regular file"),
            "missing": (tmp_path / "missing.txt", FileNotFoundError, "not found")}


@pytest.mark.parametrize("kind", ["folder", "dangling", "fifo", "missing"])
@pytest.mark.parametrize("reader", ["read_text", "read_conll", "load_documents", "read_json_documents"])
def test_a_path_that_is_not_a_file_is_named_for_what_it_is(tmp_path, kind, reader):
    path, error, message = _not_files(tmp_path)[kind]
    read = {"read_text": read_text, "read_conll": read_conll, "read_json_documents": read_json_documents,
            "load_documents": lambda p: load_documents(files=[p])}[reader]
    with pytest.raises(error, match=message) as info:
        read(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(("bom", "encoding"), [(codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"),
                                               (codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32")])
def test_a_utf16_or_utf32_file_is_named_as_such(tmp_path, bom, encoding):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bom + "text".encode(encoding.lower() + ("-le" if bom in (codecs.BOM_UTF16_LE,
                                                                               codecs.BOM_UTF32_LE) else "-be")))
    with pytest.raises(DataFormatError, match=f"the file is {encoding}"):
        read_text(path)


def test_a_file_without_any_document_and_an_empty_file_list_are_refused(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("a document")
    for name, data in (("empty.txt", b""), ("blank.txt", b" \n\t\n\xc2\xa0\n"), ("blank.jsonl", b'{"text": " "}\n')):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataFormatError, match=f"{name}: holds no document"):
            load_documents(files=[good, tmp_path / name])
    with pytest.raises(ValueError, match="empty list"):
        load_documents(files=[])
    with pytest.raises(ValueError, match="single path"):
        load_documents(files=str(good))
    with pytest.raises(ValueError, match="not both"):
        load_documents(dataset="plays", files=[good])


# -- limits that would give nothing ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(["some text to learn a few merges from"] * 20, vocab_size=300)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_blocks": -1}, "max_blocks must be an integer >= 1; got -1"),
    ({"max_blocks": 0}, "max_blocks must be an integer >= 1; got 0"),
    ({"max_blocks": -7}, "max_blocks"), ({"max_blocks": 2.5}, "max_blocks"), ({"max_blocks": True}, "max_blocks"),
    ({"max_blocks": "3"}, "max_blocks"), ({"block_size": 1}, "block_size"), ({"block_size": 0}, "block_size"),
    ({"block_size": -4}, "block_size"), ({"block_size": 4.0}, "block_size"), ({"block_size": True}, "block_size"),
])
def test_pack_into_blocks_refuses_limits_that_give_no_block(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pack_into_blocks(tokenizer, ["some text"] * 50, **({"block_size": 4} | kwargs))


def test_pack_into_blocks_refuses_non_text_and_a_tokenizer_without_eos(tokenizer):
    with pytest.raises(ValueError, match=r"texts\[1\] is a NoneType"):
        pack_into_blocks(tokenizer, ["a", None], block_size=4)
    no_eos = train_bpe_tokenizer(["abc"], vocab_size=300)
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="no eos_token_id"):
        pack_into_blocks(no_eos, ["some text"] * 50, block_size=4)


@pytest.mark.parametrize("vocab_size", [0, -1, 100, 257, 300.0])
def test_a_bpe_vocabulary_smaller_than_the_byte_alphabet_is_refused(vocab_size):
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 258"):
        train_bpe_tokenizer(["abc"], vocab_size=vocab_size)


# -- few-shot draws -------------------------------------------------------------------------------------------


@st.composite
def _pool(draw):
    size = draw(st.integers(1, 60))
    with_entity = draw(st.sets(st.integers(0, size - 1), min_size=1, max_size=3))
    return [{"tokens": [f"w{i}", "x"], "ner_tags": ["O", "B-PER" if i in with_entity else "O"]} for i in range(size)]


@PROPERTY
@given(pool=_pool(), fraction=st.floats(0, 1), seed=st.integers(0, 10_000))
def test_a_sentence_draw_never_is_entity_free(pool, fraction, seed):
    n = max(1, round(fraction * len(pool)))
    drawn = sample_sentences(pool, n, seed)
    assert len(drawn) == n and len({s["tokens"][0] for s in drawn}) == n
    assert count_entities(drawn)
    assert drawn == sample_sentences(pool, n, seed)
    uniform = [pool[i] for i in random.Random(seed).sample(range(len(pool)), n)]
    if count_entities(uniform):
        assert drawn == uniform  # a draw that held an entity already is kept as drawn


def test_the_reported_pool_with_one_entity_sentence(tmp_path):
    pool = [{"tokens": ["Ann"], "ner_tags": ["B-PER"]}] + [{"tokens": [f"w{i}"], "ner_tags": ["O"]} for i in range(99)]
    assert all(count_entities(sample_sentences(pool, 10, seed)) for seed in range(50))


def test_iob1_mentions_are_counted_and_sampled():
    pool = [{"tokens": ["Ann", "Lee", "and", "Bo"], "ner_tags": ["I-PER", "I-PER", "O", "I-PER"]},
            {"tokens": ["x"], "ner_tags": ["O"]}]
    assert count_entities(pool) == {"PER": 2}
    assert sample_kshot(pool, 2, seed=0) == pool[:1]


@pytest.mark.parametrize(("call", "message"), [
    (lambda pool: sample_sentences(pool, 1.5, 0), "n must be an integer"),
    (lambda pool: sample_sentences(pool, True, 0), "n must be an integer"),
    (lambda pool: sample_kshot(pool, 1.0, 0), "k must be an integer"),
    (lambda pool: sample_kshot(pool, 1, 0, entity_types="PER"), "the string 'PER'"),
])
def test_sampler_arguments_of_the_wrong_kind_are_refused(call, message):
    pool = [{"tokens": ["Ann"], "ner_tags": ["B-PER"]}]
    with pytest.raises(ValueError, match=message):
        call(pool)


def test_a_conll_error_is_still_a_conll_error(tmp_path):
    path = tmp_path / "train.conll"
    path.write_text("John\xa0Smith\n")  # one column: the no-break space no longer splits it into a "tag"
    with pytest.raises(ConllFormatError, match=":1: expected a token and a tag"):
        read_conll(path)
