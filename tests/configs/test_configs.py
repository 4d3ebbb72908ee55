"""Every JSON under configs/ (except configs/accelerate/) builds a valid config, and the paper-size models
have the papers' shapes; big models are instantiated on the meta device (no weights are allocated)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

import depthfusion_hf  # noqa: F401  (registers the model types)
from depthfusion_hf.families import FAMILIES, causal_lm_families
from depthfusion_hf.recipes.clm import BASELINE, build_config, load_arch
from depthfusion_hf.recipes.ner import NerSettings, load_selected
from depthfusion_hf.recipes.ner_study import NerStudySettings
from tests.moda.moda_cost import moda_cost

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ALL_JSON = sorted(p for p in CONFIGS.rglob("*.json") if "accelerate" not in p.relative_to(CONFIGS).parts)


def model_config(path: Path):
    """A config with ``model_type``: the registered config class, built from the file's fields."""
    fields = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def on_meta(config) -> torch.nn.Module:
    """The family's task model for ``config`` with every parameter on the meta device."""
    if isinstance(config, LlamaConfig) and config.model_type == "llama":
        auto_class = transformers.AutoModelForCausalLM
    else:
        auto_class = FAMILIES[config.model_type].task_auto_class
    with torch.device("meta"):
        model = auto_class.from_config(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    return model


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_configs_folder_has_the_paper_and_tiny_sizes():
    names = {p.name for p in ALL_JSON}
    assert {"denseformer_48x4x5_paper.json", "moda_700m.json", "moda_1p5b.json"} <= names
    assert {"denseformer_tiny.json", "moda_tiny.json", "dwatt_tiny.json"} <= names


@pytest.mark.parametrize("path", ALL_JSON, ids=[str(p.relative_to(CONFIGS)) for p in ALL_JSON])
def test_every_config_builds(path):
    data = json.loads(path.read_text())
    assert isinstance(data, dict), f"{path.name}: a JSON object"
    if "model_type" in data:  # a model config: builds the registered config class, and the model on meta
        config = model_config(path)
        assert config.model_type in FAMILIES, config.model_type
        assert count(on_meta(config)) > 0
    elif set(data) - {"_comment"} <= set(LlamaConfig.__dataclass_fields__):
        # an architecture for scripts/train_clm.py --config: valid for every model kind it can build
        for kind in (*causal_lm_families(), BASELINE):
            config = build_config(kind, {"vocab_size": 100, **load_arch(path)})
            assert count(on_meta(config)) > 0
    elif path.name.startswith("ner_study_"):  # the NER study's settings (unknown keys are rejected)
        settings = NerStudySettings.from_values(data)
        for key, value in data.items():
            if key != "sizes" and not key.startswith("_"):  # sizes are parsed into objects; _comment is prose
                target = settings if hasattr(settings, key) else settings.base
                assert getattr(target, key) == value, key
    elif path.name.endswith("_selected.json"):  # a NER study's choices, read by the recipe config(s) beside it
        readers = [p for p in ALL_JSON if json.loads(p.read_text()).get("selected_settings") == path.name]
        assert readers, f"{path.name}: no recipe config reads it"
        for reader in readers:  # holds a point for every (size, fusion) of the reader's grid (else ValueError)
            assert load_selected(NerSettings.from_config(reader))
    else:  # a NER recipe config: the recipe's settings must accept every key (unknown ones are rejected)
        assert path.name.startswith("ner_"), f"{path.name}: not a model, architecture or known recipe config"
        settings = NerSettings.from_config(path)
        for key, value in data.items():
            if key == "selected_settings":  # read beside the config
                assert settings.selected_settings == str(path.parent / value) and Path(value).name == value
            elif key != "sizes" and not key.startswith("_"):  # sizes are parsed into objects; _comment is prose
                assert getattr(settings, key) == value, key


def test_denseformer_paper_config_is_48_blocks_4x5_at_the_papers_width():
    config = model_config(CONFIGS / "denseformer_48x4x5_paper.json")
    assert (config.num_hidden_layers, config.dwa_dilation, config.dwa_period) == (48, 4, 5)
    assert (config.hidden_size, config.num_attention_heads, config.head_dim) == (512, 8, 64)  # 8 heads x 64
    assert config.max_position_embeddings >= 256  # the paper's sequence length
    model = on_meta(config)
    # DWA steps after blocks i = 5, 10, ..., 45, each over the outputs j <= i with j = i (mod 4)
    alphas = sum(len(range(i % 4, i + 1, 4)) for i in range(5, 49, 5))
    assert model.model.dwa.alphas.numel() == alphas == 62
    llama_fields = {k: v for k, v in config.to_dict().items() if k in LlamaConfig.__dataclass_fields__}
    llama_fields.pop("model_type", None)
    # the only parameters added to the same-shape Llama are the DWA weights
    assert count(model) == count(on_meta(LlamaConfig(**llama_fields))) + alphas


@pytest.mark.parametrize("name,params,baseline", [("moda_700m.json", 705.7e6, 669.0e6),
                                                  ("moda_1p5b.json", 1.48e9, 1.42e9)])
def test_moda_paper_configs_have_the_papers_sizes(name, params, baseline):
    config = model_config(CONFIGS / name)
    assert config.moda_ffn_kv and config.num_attention_heads // config.num_key_value_heads == 2  # G = 2
    model = on_meta(config)
    assert count(model) == moda_cost(config, 4096).params  # the model and the independent counter agree
    assert abs(count(model) - params) / params < 0.005  # Table 3 row 4 (700M); the 1.5B shape's total
    llama_fields = {k: v for k, v in config.to_dict().items() if k in LlamaConfig.__dataclass_fields__}
    llama_fields.pop("model_type", None)
    with torch.device("meta"):
        plain = LlamaForCausalLM(LlamaConfig(**llama_fields))
    assert abs(count(plain) - baseline) / baseline < 0.005  # Table 3 row 1 (OLMo2 36L: 669.0M)


def test_tiny_configs_run_a_forward_pass():
    ids = torch.randint(3, 97, (1, 7))
    for name in ("denseformer_tiny.json", "moda_tiny.json"):
        model = transformers.AutoModelForCausalLM.from_config(model_config(CONFIGS / name)).eval()
        with torch.no_grad():
            assert model(ids).logits.shape == (1, 7, 97)
    config = model_config(CONFIGS / "dwatt_tiny.json")
    model = transformers.AutoModelForTokenClassification.from_config(config).eval()
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, 7, 21)
    assert config.id2label[13] == "B-person"
