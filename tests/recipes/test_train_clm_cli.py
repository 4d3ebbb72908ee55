"""``scripts/train_clm.py``'s command line refuses impossible values before any work, naming the option: every
numeric option (``--max_train_blocks 0``, ``--gradient_accumulation_steps 0``, NaN or infinite rates, ...) and
the ``--config`` file (not JSON, not an object, another ``model_type``, a misspelt field)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import set_seed

from depthfusion_hf.families import causal_lm_families
from depthfusion_hf.recipes.clm import BASELINE, baseline_arch, build_model, load_arch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import train_clm  # noqa: E402

KINDS = ("denseformer", "moda", "attnres")
SETTINGS = dict(max_examples=25, deadline=None, derandomize=True, database=None)
# option -> (smallest valid integer, largest valid integer or None)
INTEGER_OPTIONS = {"--vocab_size": (258, None), "--block_size": (2, None), "--max_train_blocks": (1, None),
                   "--max_eval_blocks": (1, None), "--max_steps": (1, None), "--batch_size": (1, None),
                   "--gradient_accumulation_steps": (1, None), "--eval_steps": (0, None), "--logging_steps": (1, None),
                   "--save_steps": (0, None), "--seed": (0, 2**32 - 1)}
# option -> (lower bound, upper bound or None, lower bound allowed, upper bound allowed)
REAL_OPTIONS = {"--learning_rate": (0.0, None, False, False), "--weight_decay": (0.0, None, True, False),
                "--warmup_ratio": (0.0, 1.0, True, True), "--validation_fraction": (0.0, 1.0, False, False),
                "--new_param_lr_scale": (0.0, None, False, False)}


def parse(*argv: str):
    """``parse_args(argv)``: the namespace, or the exit status and stderr."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return train_clm.parse_args(list(argv))
    except SystemExit as exit_:
        return exit_.code, err.getvalue()


@settings(**SETTINGS)
@given(option=st.sampled_from(sorted(INTEGER_OPTIONS)), value=st.integers(-2**40, 2**40))
def test_an_integer_option_is_accepted_exactly_in_its_range(option, value):
    low, high = INTEGER_OPTIONS[option]
    extra = ("--init_from", "x") if option == "--new_param_lr_scale" else ()
    got = parse(f"{option}={value}", *extra)
    if value >= low and (high is None or value <= high):
        assert getattr(got, option[2:]) == value
    else:
        code, err = got
        assert code == 2 and f"argument {option}: must be an integer" in err and str(value) in err


@pytest.mark.parametrize("option", sorted(INTEGER_OPTIONS))
@pytest.mark.parametrize("text", ["1.5", "x", "", "nan"])
def test_an_integer_option_refuses_text_that_is_no_integer(option, text):
    code, err = parse(option, text)
    assert code == 2 and f"argument {option}: invalid integer value" in err


@settings(**SETTINGS)
@given(option=st.sampled_from(sorted(REAL_OPTIONS)),
       value=st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 1.0, float("nan"), -1e-300]))
def test_a_real_option_is_accepted_exactly_when_finite_and_in_range(option, value):
    low, high, low_ok, high_ok = REAL_OPTIONS[option]
    extra = ("--init_from", "x") if option == "--new_param_lr_scale" else ()
    got = parse(f"{option}={value!r}", *extra)
    valid = math.isfinite(value) and (value >= low if low_ok else value > low) and (
        high is None or (value <= high if high_ok else value < high))
    if valid:
        assert getattr(got, option[2:]) == value
    else:
        code, err = got
        assert code == 2 and f"argument {option}: must be a finite number" in err


def test_the_issue_examples_are_refused_naming_the_option():
    for argv, message in [(["--max_train_blocks", "0"], "argument --max_train_blocks: must be an integer >= 1; got 0"),
                          (["--gradient_accumulation_steps", "0"],
                           "argument --gradient_accumulation_steps: must be an integer >= 1; got 0"),
                          (["--max_steps", "0"], "argument --max_steps: must be an integer >= 1; got 0"),
                          (["--learning_rate", "nan"], "argument --learning_rate: must be a finite number > 0")]:
        code, err = parse(*argv)
        assert code == 2 and message in err, err


@pytest.mark.parametrize("text,message", [("not json", "not valid JSON"), ("[1]", "must be a JSON object"),
                                          ('{"hidden_size": 32,}', "not valid JSON"),
                                          ('{"num_hiden_layers": 2}', "nearest valid name is `num_hidden_layers`"),
                                          ('{"model_type": "moda"}', "model_type 'moda', not 'denseformer'")])
def test_a_bad_config_file_is_refused_naming_the_option(tmp_path, text, message):
    path = tmp_path / "arch.json"
    path.write_text(text)
    code, err = parse("--config", str(path))
    assert code == 2 and "--config:" in err and message in err and str(path) in err


def test_a_missing_config_file_or_a_folder_is_refused_naming_the_option(tmp_path):
    for path in (tmp_path / "missing.json", tmp_path):
        code, err = parse("--config", str(path))
        assert code == 2 and "--config:" in err and str(path) in err


def test_a_family_config_file_needs_its_own_model():
    code, err = parse("--model", "denseformer", "--config", str(REPO / "configs" / "moda_tiny.json"))
    assert code == 2 and "model_type 'moda', not 'denseformer': pass --model moda" in err
    assert parse("--model", "moda", "--config", str(REPO / "configs" / "moda_tiny.json")).model == "moda"



@pytest.mark.parametrize("argv,option,owner", [
    (["--attnres_block_size", "2"], "--attnres_block_size", "attnres"),  # --model left at its default
    (["--model", "denseformer", "--norm_position", "post"], "--norm_position", "moda"),
    (["--model", "moda", "--dwa_period", "2"], "--dwa_period", "denseformer"),
    (["--model", "attnres", "--hc_mult", "2"], "--hc_mult", "mhc"),
])
def test_an_option_of_another_family_is_refused_naming_it(argv, option, owner):
    """An option of a family other than ``--model`` would be silently ignored (a default model trained)."""
    code, err = parse(*argv)
    assert code == 2 and f"{option} is an option of --model {owner}" in err, err


@pytest.mark.parametrize("key,near", [("num_hiden_layers", "num_hidden_layers"), ("hidden_sise", "hidden_size"),
                                      ("rms_norm_epsilon", "rms_norm_eps"), ("tie_word_embedding",
                                                                              "tie_word_embeddings")])
def test_a_config_file_with_a_misspelt_llama_field_is_an_error_naming_the_nearest(key, near, tmp_path):
    path = tmp_path / "arch.json"
    path.write_text(json.dumps({"hidden_size": 32, key: 1}))
    with pytest.raises(ValueError, match=rf"`{key}` is not a config field; the nearest valid name is `{near}`"):
        load_arch(path, "denseformer")


@pytest.mark.parametrize("kind,other", [(k, o) for k in KINDS for o in KINDS if k != o])
def test_a_config_file_of_another_model_type_is_an_error(kind, other, tmp_path):
    path = tmp_path / f"{other}.json"
    path.write_text(json.dumps({"model_type": other, "hidden_size": 32}))
    with pytest.raises(ValueError, match=rf"model_type '{other}', not '{kind}': pass --model {other}"):
        load_arch(path, kind)
    assert load_arch(path, other) == {"hidden_size": 32}
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))  # plain Llama fields suit every family
    assert load_arch(path, kind) == {"hidden_size": 32}


@pytest.mark.parametrize("text,message", [("{'hidden_size': 32}", "not valid JSON"), ("[1, 2]", "a JSON object"),
                                          ('{"hidden_size": 32,}', "not valid JSON"), ("", "not valid JSON"),
                                          ('{\n  "hidden_size": 32\n  "x": 1\n}', r":3: not valid JSON")])
def test_a_config_file_that_is_not_a_json_object_names_the_file(text, message, tmp_path):
    path = tmp_path / "arch.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_arch(path, "moda")
    assert str(path) in str(info.value)


def test_a_pretty_printed_config_file_with_comments_and_a_bom_loads(tmp_path):
    path = tmp_path / "arch.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"_comment": "x", "_note": "y", "hidden_size": 32,
                                                   "model_type": "moda"}, indent=4).encode())
    assert load_arch(path, "moda") == {"hidden_size": 32}


@pytest.mark.parametrize("name,text", [("results.md", "# my notes on these runs\n"),
                                       ("results.json", '{"mine": true}'), ("results.json", "not json")])
def test_a_results_file_of_the_users_own_is_never_replaced(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=rf"{tmp_path / name} exists and was not written by train_clm.py"):
        train_clm.main(["--output_dir", str(tmp_path), "--max_steps", "1"])
    assert (tmp_path / name).read_text() == text
    assert not list(tmp_path.glob("*/final"))


class _Captured(Exception):
    """Raised by the stand-in ``train_one`` once it has the family model (nothing trains)."""


@pytest.mark.parametrize("family", sorted(causal_lm_families()))
def test_the_family_model_starts_from_the_same_seed_baselines_weights(family, tmp_path, monkeypatch):
    # Before: the family's extra parameters consumed random numbers first, so e.g. 35 of an mHC model's 57 Llama
    # tensors differed from its same-seed baseline's and the main job's comparison mixed two initialisations.
    captured = {}

    def capture(name, model, *args, **kwargs):
        captured["model"] = model
        raise _Captured

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"In the beginning {i} was the word and the word was {i * 7}." for i in range(200)))
    monkeypatch.setattr(train_clm, "train_one", capture)
    with pytest.raises(_Captured):
        train_clm.main(["--model", family, "--config", "configs/clm_tiny.json", "--train_files", str(corpus),
                        "--validation_files", str(corpus), "--output_dir", str(tmp_path / "out"), "--seed", "3"])
    model = captured["model"]
    set_seed(3)
    llama = build_model(BASELINE, baseline_arch(model)).state_dict()
    own = model.state_dict()
    assert set(llama) <= set(own)
    for name, value in llama.items():
        assert torch.equal(own[name], value), name
