"""The decoder configs (DenseFormer, MoDA, AttnRes, mHC) reject what they cannot use, by construction and from a saved
``config.json``: misspelt or foreign family options (naming the nearest valid name) and impossible values of the
inherited Llama fields (NaN or <= 0 norm eps and RoPE parameters, unknown activations, special token ids outside
the vocabulary, ...); the keys transformers and users keep in configs pass through. (``train_clm.py --config``
files: ``tests/recipes/test_train_clm_cli.py``.)"""

from __future__ import annotations

import dataclasses
import json
import math
import string

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.activations import ACT2FN

from depthfusion_hf import AttnResConfig, DenseFormerConfig, MHCConfig, MoDAConfig
from depthfusion_hf.models.configuration_decoder import (
    DecoderConfigMixin,
    check_unknown_options,
    decoder_configs,
    one_typo_apart,
)

CLASSES = {"denseformer": DenseFormerConfig, "moda": MoDAConfig, "attnres": AttnResConfig, "mhc": MHCConfig}
# The prefixes of the decoder families' options (each config declares its own `option_prefix`).
OPTION_PREFIXES = tuple(cls.option_prefix for cls in decoder_configs())
TINY = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
SETTINGS = dict(max_examples=40, deadline=None, derandomize=True, database=None)


def options(cls) -> list[str]:
    """The fields a family adds to Llama's: its own options."""
    return sorted(f.name for f in dataclasses.fields(cls) if f.name not in LlamaConfig.__dataclass_fields__)


def one_edit(word: str, data) -> str:
    """``word`` with one deletion, insertion, substitution or transposition (the usual typos)."""
    kind = data.draw(st.sampled_from(["delete", "insert", "substitute", "transpose"]))
    at = data.draw(st.integers(0, len(word) - 2))
    letter = data.draw(st.sampled_from(string.ascii_lowercase + "_"))
    if kind == "delete":
        return word[:at] + word[at + 1:]
    if kind == "insert":
        return word[:at] + letter + word[at:]
    if kind == "substitute":
        return word[:at] + letter + word[at + 1:]
    return word[:at] + word[at + 1] + word[at] + word[at + 2:]


@settings(**SETTINGS)
@given(data=st.data())
def test_a_misspelt_family_option_is_an_error_naming_it_and_the_nearest_name(data):
    kind = data.draw(st.sampled_from(sorted(CLASSES)))
    cls = CLASSES[kind]
    option = data.draw(st.sampled_from(options(cls)))
    typo = one_edit(option, data)
    fields = {f.name for f in dataclasses.fields(cls)}
    if typo in fields:
        return  # the edit gave a real field (e.g. back to the option)
    with pytest.raises(ValueError) as info:
        cls(**TINY, **{typo: 1})
    message = str(info.value)
    assert f"`{typo}` is not a field of {cls.__name__}" in message
    assert "nearest valid name is `" in message and any(f"`{name}`" in message for name in options(cls))


FOREIGN = [(kind, key) for kind, cls in CLASSES.items() for other, other_cls in CLASSES.items() if other != kind
           for key in options(other_cls) if key not in options(cls)]


@pytest.mark.parametrize("kind,key", FOREIGN, ids=[f"{kind}-{key}" for kind, key in FOREIGN])
def test_another_familys_option_is_an_error_naming_it(kind, key, tmp_path):
    cls = CLASSES[kind]
    with pytest.raises(ValueError, match=f"`{key}` is not a field of {cls.__name__}"):
        cls(**TINY, **{key: 2})
    # the same from a saved config.json (e.g. edited by hand) and through AutoConfig
    fields = cls(**TINY).to_dict() | {key: 2}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    for load in (cls.from_pretrained, AutoConfig.from_pretrained):
        with pytest.raises(ValueError, match=f"`{key}` is not a field of {cls.__name__}"):
            load(tmp_path)


@pytest.mark.parametrize("typo,nearest", [("hc_iters", "hc_sinkhorn_iters"), ("hc_epsilon", "hc_eps"),
                                           ("hc_streams", "hc_mult"), ("hc_sinkhorn", "hc_sinkhorn_iters")])
def test_a_key_with_the_familys_option_prefix_is_an_error_naming_the_nearest_option(typo, nearest, tmp_path):
    """Before, `MHCConfig(hc_iters=5)` left `hc_sinkhorn_iters` at 20 and `hc_epsilon=1e-3` left `hc_eps` at 1e-6:
    the check knew a fixed list of family prefixes (`mhc_`, not mHC's `hc_`) and only near misses (ratio >= 0.85)."""
    with pytest.raises(ValueError, match=f"`{typo}` is not a field of MHCConfig") as info:
        MHCConfig(**TINY, **{typo: 5})
    if nearest != "hc_mult":  # "streams" shares no word with an option: the closest name is only a guess
        assert f"nearest valid name is `{nearest}`" in str(info.value)
    (tmp_path / "config.json").write_text(json.dumps(MHCConfig(**TINY).to_dict() | {typo: 5}))
    with pytest.raises(ValueError, match=f"`{typo}` is not a field of MHCConfig"):
        AutoConfig.from_pretrained(tmp_path)


def test_a_decoder_config_without_an_option_prefix_is_refused_when_built():
    """The unknown-option check reads each config's own `option_prefix`: a new family cannot forget it. Defining the
    class is allowed (cloudpickle, in vLLM's engine process, rebuilds a class before it sets its attributes)."""
    new_family = type("NewFamilyConfig", (DecoderConfigMixin, LlamaConfig), {"model_type": "new"})
    with pytest.raises(TypeError, match="must set `option_prefix`"):
        new_family()
    assert new_family not in decoder_configs()
    assert {cls.__name__ for cls in decoder_configs()} >= {cls.__name__ for cls in CLASSES.values()}


# Keys transformers, the Hub and users keep in configs: they must keep loading.
PASSED_THROUGH = {"auto_map": {"AutoConfig": "x.Y"}, "torch_dtype": "float32", "tokenizer_class": "LlamaTokenizer",
                  "sep_token_id": 3, "decoder_start_token_id": 1, "num_labels": 2, "rope_theta": 5000.0,
                  "max_length": 20, "temperature": 0.7, "my_note": "trained on a Sunday", "hidden_sizes": [16],
                  "attention_heads": 2, "_name_or_path": "me/model", "output_attentions": False,
                  "use_sliding_window": False, "transformers_version": "5.24.0", "pretraining_tp": 1}


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_the_keys_transformers_and_users_keep_in_configs_still_load(kind, tmp_path):
    cls = CLASSES[kind]
    config = cls(**TINY, **PASSED_THROUGH)
    assert config.my_note == "trained on a Sunday" and config.rope_parameters["rope_theta"] == 5000.0
    config.save_pretrained(tmp_path)
    again = AutoConfig.from_pretrained(tmp_path)
    assert type(again) is cls and again.my_note == "trained on a Sunday"


@settings(**SETTINGS)
@given(kind=st.sampled_from(sorted(CLASSES)), key=st.from_regex(r"[a-z][a-z_]{2,18}", fullmatch=True))
def test_an_unknown_key_far_from_every_option_passes(kind, key):
    import difflib

    cls = CLASSES[kind]
    fields = {f.name for f in dataclasses.fields(cls)}
    every_option = {name for other in decoder_configs() for name in options(other)}
    looks_like_an_option = (difflib.get_close_matches(key, options(cls), n=1, cutoff=0.85)
                            or any(one_typo_apart(key, name) for name in options(cls))
                            or key.startswith(OPTION_PREFIXES) or key in every_option)
    if key in fields or looks_like_an_option or key in ("rope_scaling", "rope_theta", "rope_type", "num_labels"):
        return
    assert getattr(cls(**TINY, **{key: 1}), key) == 1


def transformers_config_fields() -> set[str]:
    """The field names of every config class transformers ships (its model tests pass such keys to any config,
    e.g. ``norm_epsilon``, and saved configs of other architectures carry them)."""
    import importlib
    import pkgutil

    import transformers.models
    from transformers import PreTrainedConfig

    names = set()
    for module in pkgutil.iter_modules(transformers.models.__path__):
        try:
            found = importlib.import_module(f"transformers.models.{module.name}.configuration_{module.name}")
        except ImportError:  # a model folder without a configuration module, or with a missing optional import
            continue
        for value in vars(found).values():
            if isinstance(value, type) and issubclass(value, PreTrainedConfig) and dataclasses.is_dataclass(value):
                names |= {field.name for field in dataclasses.fields(value)}
    return names


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_no_field_of_a_transformers_config_is_taken_for_a_family_option(kind):
    """Before the cutoff was 0.85, ``norm_epsilon`` (a key transformers' common tests set) was refused as a near
    miss of MoDA's ``norm_position`` (ratio 0.8); single-character typos of our options have ratio >= 0.9. Refused
    on purpose: only the hyper-connection options of transformers' configs (``hc_*``), which mHC's prefix claims
    (mHC's own are DeepSeek-V4's; ``hc_lowrank`` and the like are options mHC does not have)."""
    cls = CLASSES[kind]
    names = transformers_config_fields() - {f.name for f in dataclasses.fields(cls)}
    assert len(names) > 1000 and {"norm_epsilon", "dilation", "n_positions", "max_period"} <= names
    claimed = {name for name in names if name.startswith(OPTION_PREFIXES)}
    assert claimed and all(name.startswith("hc_") for name in claimed), claimed
    check_unknown_options(cls, sorted(names - claimed))  # raises on the first one it would refuse


# (field, bad values): each was accepted before and gave NaN logits, a bare KeyError / assertion, or a silent change.
BAD_VALUES = {
    "rms_norm_eps": [float("nan"), float("inf"), -1.0, 0.0, -1e-6],
    "hidden_act": ["swiglu", "SiLU", "", "relu "],
    "pad_token_id": [50, 51, -1],
    "bos_token_id": [50, -3],
    "eos_token_id": [50, [2, 50], [-1]],
    "max_position_embeddings": [0, -5],
    "attention_dropout": [float("nan"), -0.1, 1.0, 2.0],
    "dtype": ["int8", "bool", "foo"],
    "rope_parameters": [{"rope_type": "default", "rope_theta": -1.0}, {"rope_type": "default", "rope_theta": 0.0},
                        {"rope_type": "default", "rope_theta": float("nan")}, {"rope_type": "foo", "rope_theta": 1e4},
                        {"rope_type": "linear", "rope_theta": 1e4, "factor": -2.0},
                        {"rope_type": "linear", "rope_theta": 1e4, "factor": float("inf")}],
}
CASES = [(kind, field, value) for kind in sorted(CLASSES) for field, values in BAD_VALUES.items() for value in values]


@pytest.mark.parametrize("kind,field,value", CASES, ids=[f"{k}-{f}-{v!r}" for k, f, v in CASES])
def test_an_impossible_inherited_llama_value_is_an_error_naming_the_field(kind, field, value, tmp_path):
    cls = CLASSES[kind]
    with pytest.raises(ValueError, match=rf"`{field}") as info:
        cls(**TINY, **{field: value})
    # a config.json holding the value raises the same error through from_pretrained
    fields = cls(**TINY).to_dict()
    fields[field] = str(value).removeprefix("torch.") if field == "dtype" else value
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=rf"`{field}"):
        AutoConfig.from_pretrained(tmp_path)
    assert "must be" in str(info.value)


@pytest.mark.parametrize("kind", sorted(CLASSES))
@pytest.mark.parametrize("legacy", [{"rope_theta": -1.0}, {"rope_theta": float("nan")},
                                    {"rope_scaling": {"rope_type": "linear", "factor": 0.0}}])
def test_legacy_rope_keys_are_validated_after_transformers_folds_them_in(kind, legacy):
    with pytest.raises(ValueError, match=r"`rope_parameters\['"):
        CLASSES[kind](**TINY, **legacy)


@settings(**SETTINGS)
@given(kind=st.sampled_from(sorted(CLASSES)),
       eps=st.floats(allow_nan=True, allow_infinity=True, width=64))
def test_rms_norm_eps_is_accepted_exactly_when_finite_and_positive(kind, eps):
    if math.isfinite(eps) and eps > 0:
        assert CLASSES[kind](**TINY, rms_norm_eps=eps).rms_norm_eps == eps
    else:
        with pytest.raises(ValueError, match="`rms_norm_eps` must be a finite number > 0"):
            CLASSES[kind](**TINY, rms_norm_eps=eps)


@settings(**SETTINGS)
@given(kind=st.sampled_from(sorted(CLASSES)), theta=st.floats(allow_nan=True, allow_infinity=True, width=64))
def test_rope_theta_is_accepted_exactly_when_finite_and_positive(kind, theta):
    rope = {"rope_type": "default", "rope_theta": theta}
    if math.isfinite(theta) and theta > 0:
        assert CLASSES[kind](**TINY, rope_parameters=rope).rope_parameters["rope_theta"] == theta
    else:
        with pytest.raises(ValueError, match=r"`rope_parameters\['rope_theta'\]` must be a finite number > 0"):
            CLASSES[kind](**TINY, rope_parameters=rope)


@settings(**SETTINGS)
@given(kind=st.sampled_from(sorted(CLASSES)), name=st.sampled_from(["pad_token_id", "bos_token_id", "eos_token_id"]),
       token=st.integers(-1000, 1000))
def test_special_token_ids_are_accepted_exactly_inside_the_vocabulary(kind, name, token):
    if 0 <= token < TINY["vocab_size"]:
        assert getattr(CLASSES[kind](**TINY, **{name: token}), name) == token
    else:
        with pytest.raises(ValueError, match=rf"`{name}` must be None or an integer in \[0, vocab_size=50\)"):
            CLASSES[kind](**TINY, **{name: token})


@settings(**SETTINGS)
@given(kind=st.sampled_from(sorted(CLASSES)), act=st.text(min_size=0, max_size=12))
def test_hidden_act_is_accepted_exactly_when_transformers_knows_it(kind, act):
    if act in ACT2FN:
        assert CLASSES[kind](**TINY, hidden_act=act).hidden_act == act
    else:
        with pytest.raises(ValueError, match="`hidden_act` must be one of"):
            CLASSES[kind](**TINY, hidden_act=act)


@pytest.mark.parametrize("kind", sorted(CLASSES))
@pytest.mark.parametrize("field,value", [("rms_norm_eps", float("nan")), ("hidden_act", "nope"),
                                         ("pad_token_id", 99), ("rope_parameters", {"rope_theta": -5.0})])
def test_a_field_changed_after_construction_is_refused_when_the_model_is_built(kind, field, value):
    config = CLASSES[kind](**TINY)
    object.__setattr__(config, field, value)  # past the strict-dataclass type check, as a careless edit would be
    with pytest.raises(ValueError, match=rf"`{field}"):
        AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_valid_edge_values_still_build_a_finite_model(kind):
    config = CLASSES[kind](**TINY, rms_norm_eps=1e-12, pad_token_id=49, bos_token_id=0, eos_token_id=[0, 49],
                           hidden_act="gelu", max_position_embeddings=1, attention_dropout=0.0,
                           rope_parameters={"rope_type": "linear", "rope_theta": 1.5, "factor": 2.0})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_a_hub_style_llama_config_converts(tmp_path):
    """The keys a Llama's config.json carries on the Hub (rope_scaling of Llama 3, torch_dtype, ...) pass."""
    from depthfusion_hf.convert import source_config_fields

    llama = LlamaConfig(**TINY, torch_dtype="bfloat16", pretraining_tp=1, mlp_bias=False, attention_bias=False,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                        rope_theta=500000.0)
    for cls in CLASSES.values():
        config = cls(**source_config_fields(llama))
        assert config.rope_parameters["rope_type"] == "llama3" and config.dtype == torch.bfloat16
