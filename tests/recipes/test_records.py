"""Records say what really happened (issue 19 §4): ``results.json`` names the data a run used (local files by name
and sha256, a Hub id with its configuration, a built-in corpus by name) and model cards carry that, never the
default corpus (before: ``--train_files my.txt`` recorded ``dataset: kjv`` and the card claimed "King James
Bible, held-out chapters")."""

from __future__ import annotations

import hashlib

import pytest
import yaml
from huggingface_hub import ModelCard
from hypothesis import given, settings
from hypothesis import strategies as st

from depthfusion_hf.model_card import build_model_card, clm_results, describe_data
from depthfusion_hf.recipes.records import data_record, file_sha256
from tests.training.builders import tiny_denseformer

RUNS = [{"name": "denseformer 1x1", "model_type": "denseformer", "eval_loss": 4.0, "perplexity": 54.6},
        {"name": "llama (baseline)", "model_type": "llama", "eval_loss": 4.2, "perplexity": 66.7}]


def results(data: dict | None, args: dict | None = None) -> dict:
    return {"args": args or {"dataset": "kjv"}, "settings": {"max_steps": 8}, "runs": RUNS} | (
        {"data": data} if data is not None else {})


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(content=st.binary(max_size=3000), name=st.from_regex(r"[a-z]{1,8}\.(txt|jsonl|json)", fullmatch=True))
def test_file_hash_is_the_sha256_of_the_bytes(tmp_path_factory, content, name):
    path = tmp_path_factory.mktemp("f") / name
    path.write_bytes(content)
    assert file_sha256(path) == hashlib.sha256(content).hexdigest()


def test_local_files_are_recorded_by_name_and_hash_whatever_the_dataset_default(tmp_path):
    train, val = tmp_path / "my.txt", tmp_path / "val.txt"
    train.write_text("one\n\ntwo\n")
    val.write_text("three\n")
    record = data_record("kjv", None, [train], [val], 0.03)  # "kjv" is train_clm's --dataset default
    assert record == {"source": "files", "name": "my.txt", "config": None,
                      "files": [{"name": "my.txt", "sha256": file_sha256(train)}],
                      "validation_files": [{"name": "val.txt", "sha256": file_sha256(val)}],
                      "validation_fraction": None}
    assert data_record("plays")["source"] == "builtin" and data_record(None)["name"] == "kjv"
    hub = data_record("wikitext", "wikitext-103-raw-v1", validation_fraction=0.05)
    assert (hub["source"], hub["name"], hub["config"], hub["validation_fraction"]) == (
        "hub", "wikitext", "wikitext-103-raw-v1", 0.05)


def card_meta(entries) -> tuple[dict, str]:
    model = tiny_denseformer()
    card = ModelCard(build_model_card(model, "me/dense", results=entries))
    return card.data.to_dict(), card.text


def test_a_card_of_a_local_files_run_names_the_files_and_their_hashes(tmp_path):
    train = tmp_path / "my.txt"
    train.write_text("some text\n")
    entries = clm_results(results(data_record("kjv", None, [train], None, 0.1), {"dataset": "kjv",
                                                                                  "train_files": [str(train)]}),
                          "denseformer")
    meta, body = card_meta(entries)
    dataset = meta["model-index"][0]["results"][0]["dataset"]
    assert dataset["type"] == "local-files" and f"my.txt (sha256 {file_sha256(train)})" in dataset["name"]
    assert "King James" not in yaml.safe_dump(meta) + body and "kjv" not in yaml.safe_dump(meta)
    assert "datasets" not in meta  # no Hub dataset to name
    assert f"my.txt (sha256 {file_sha256(train)})" in body  # the limitations text names the training data


def test_a_card_of_a_hub_run_names_the_dataset_and_its_configuration():
    entries = clm_results(results(data_record("wikitext", "wikitext-103-raw-v1")), "denseformer")
    meta, _ = card_meta(entries)
    dataset = meta["model-index"][0]["results"][0]["dataset"]
    assert (dataset["type"], dataset["config"], dataset["split"]) == ("wikitext", "wikitext-103-raw-v1", "validation")
    assert "wikitext (wikitext-103-raw-v1)" in dataset["name"] and meta["datasets"] == ["wikitext"]


@pytest.mark.parametrize("name,title", [("kjv", "King James Bible, held-out chapters"),
                                        ("plays", "Shakespeare's plays, held-out passages")])
def test_a_card_of_a_builtin_run_names_the_corpus(name, title):
    meta, _ = card_meta(clm_results(results(data_record(name)), "denseformer"))
    dataset = meta["model-index"][0]["results"][0]["dataset"]
    assert (dataset["type"], dataset["name"]) == (name, title) and meta["datasets"] == [name]


def test_results_without_a_data_record_or_a_run_field_are_refused():
    """Never guessed from the arguments (``--train_files my.txt`` once recorded ``dataset: kjv``)."""
    with pytest.raises(ValueError, match=r"a 'data' record \(got None\)"):
        clm_results(results(None, {"dataset": "kjv", "train_files": ["data/my.txt"]}), "denseformer")
    for field in ("model_type", "eval_loss", "perplexity"):
        runs = [{k: v for k, v in RUNS[0].items() if k != field}, RUNS[1]]
        with pytest.raises(ValueError, match=rf"lacking some: {{'denseformer 1x1': \['{field}'\]}}"):
            clm_results(results(data_record("kjv")) | {"runs": runs}, "denseformer")


def test_a_record_with_an_unknown_source_is_refused():
    with pytest.raises(ValueError, match="source must be 'files', 'builtin' or 'hub'; got 'ftp'"):
        describe_data({"source": "ftp", "name": "x"})
