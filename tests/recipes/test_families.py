"""The family registry drives the Auto classes, the causal-LM recipe and the export tables."""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, LlamaForCausalLM

from depthfusion_hf.export import default_model_cards_dir
from depthfusion_hf.families import FAMILIES, Family, causal_lm_families, get_family
from depthfusion_hf.recipes import clm

REPO = Path(__file__).resolve().parents[2]

ARCH = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_is_registered_with_transformers(name):
    family = FAMILIES[name]
    assert family.model_type == name == family.config_class.model_type
    assert isinstance(AutoConfig.for_model(name), family.config_class)
    assert family.task_auto_class._model_mapping[family.config_class] is family.task_model_class
    if family.base_model_class is not None:
        assert AutoModel._model_mapping[family.config_class] is family.base_model_class
    else:
        assert family.config_class not in AutoModel._model_mapping
    assert (default_model_cards_dir() / family.card_template).is_file()
    with pytest.raises(dataclasses.FrozenInstanceError):
        family.pipeline_tag = "x"


def test_get_family_names_the_registered_families():
    assert get_family("moda") is FAMILIES["moda"]
    with pytest.raises(ValueError, match=r"model_type must be one of \[.*'denseformer'.*\]; got 'llama'"):
        get_family("llama")


@pytest.mark.parametrize("kind", causal_lm_families())
def test_causal_lm_families_build_from_their_cli_options(kind):
    family = FAMILIES[kind]
    assert family.add_cli_options is not None and family.config_kwargs is not None and family.from_llama is not None
    parser = argparse.ArgumentParser()
    clm.add_family_options(parser)
    kwargs = clm.family_kwargs(kind, parser.parse_args([]))
    config = clm.build_config(kind, ARCH, **kwargs)
    assert isinstance(config, family.config_class)
    assert all(getattr(config, key) == value for key, value in kwargs.items())
    model = clm.build_model(kind, config=config)
    assert isinstance(model, family.task_model_class) and model.config is config  # the run's one config
    assert clm.run_name(config).startswith(kind)


def test_variant_names():
    assert clm.run_name(clm.build_config("denseformer", ARCH, dwa_dilation=3, dwa_period=2)) == "denseformer 3x2"
    assert clm.run_name(clm.build_config("moda", ARCH)) == "moda"
    assert clm.run_name(clm.build_config("moda", ARCH, moda_ffn_kv=False, norm_position="post")) == \
        "moda no-ffn-kv post-norm"
    assert clm.run_name(clm.build_config("llama", ARCH)) == "llama"


def test_baseline_and_unknown_kinds():
    assert clm.family_kwargs("llama", argparse.Namespace()) == {}
    assert isinstance(clm.build_model("llama", ARCH), LlamaForCausalLM)
    with pytest.raises(ValueError, match="model kind must be one of"):
        clm.build_model("dwatt", ARCH)  # a registered family, but not a causal LM


def test_a_new_registry_entry_is_all_the_recipe_needs(monkeypatch):
    """A family added to the registry (here a renamed DenseFormer) is buildable and named by the recipe."""
    dense = FAMILIES["denseformer"]
    fake = dataclasses.replace(dense, model_type="fakeformer", title="FakeFormer",
                               variant_name=lambda config: "fakeformer", add_cli_options=None,
                               config_kwargs=lambda args: {"dwa_dilation": 1, "dwa_period": 1})
    monkeypatch.setitem(FAMILIES, "fakeformer", fake)
    assert "fakeformer" in causal_lm_families()
    assert clm.family_kwargs("fakeformer", argparse.Namespace()) == {"dwa_dilation": 1, "dwa_period": 1}
    torch.manual_seed(0)
    model = clm.build_model("fakeformer", ARCH, dwa_dilation=1, dwa_period=1)
    assert isinstance(model, dense.task_model_class)
    assert isinstance(fake, Family) and fake.is_causal_lm


def test_family_config_file_fields_and_cli_overrides():
    """A family config file may carry its own fields; only options given on the command line override them."""
    arch = clm.load_arch(REPO / "configs" / "denseformer_tiny.json")  # dwa_dilation 2, dwa_period 3
    parser = argparse.ArgumentParser()
    clm.add_family_options(parser)
    from_file = clm.build_config("denseformer", arch, **clm.family_kwargs("denseformer", parser.parse_args([])))
    assert (from_file.dwa_dilation, from_file.dwa_period) == (2, 3)
    given = parser.parse_args(["--dwa_period", "2"])
    overridden = clm.build_config("denseformer", arch, **clm.family_kwargs("denseformer", given))
    assert (overridden.dwa_dilation, overridden.dwa_period) == (2, 2)
    defaults = clm.build_config("moda", clm.load_arch(REPO / "configs" / "clm_tiny.json"),
                                **clm.family_kwargs("moda", parser.parse_args(["--no-moda_ffn_kv"])))
    assert (defaults.moda_ffn_kv, defaults.norm_position) == (False, "pre")


def test_an_fsdp_launch_that_runs_without_fsdp_is_reported(monkeypatch):
    """accelerate drops an FSDP config on CPU-only machines; the recipe says so instead of staying silent."""

    class Trainer:
        is_fsdp_enabled = False

    for flag in ("true", "True", "1"):  # how accelerate launch sets it
        monkeypatch.setenv("ACCELERATE_USE_FSDP", flag)
        with pytest.warns(UserWarning, match="runs without FSDP"):
            clm.warn_if_sharding_dropped(Trainer())
    Trainer.is_fsdp_enabled = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clm.warn_if_sharding_dropped(Trainer())
    Trainer.is_fsdp_enabled = False
    for flag in ("false", None):
        if flag is None:
            monkeypatch.delenv("ACCELERATE_USE_FSDP")
        else:
            monkeypatch.setenv("ACCELERATE_USE_FSDP", flag)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            clm.warn_if_sharding_dropped(Trainer())
