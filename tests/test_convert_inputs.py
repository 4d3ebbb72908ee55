"""llama_to_denseformer / llama_to_moda / llama_to_attnres refuse what is not a Llama checkpoint, naming what
they found, instead of returning a randomly initialised model with load warnings."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

from depthfusion_hf import (
    AttnResConfig,
    AttnResForCausalLM,
    DenseFormerConfig,
    DenseFormerForCausalLM,
    MoDAConfig,
    MoDAForCausalLM,
)
from depthfusion_hf.convert import llama_to_attnres, llama_to_denseformer, llama_to_moda
from tests.causal_lm_checks import TINY_DECODER

CONVERTERS = [llama_to_denseformer, llama_to_moda, llama_to_attnres]


def tiny_bert() -> BertForMaskedLM:
    return BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=24, max_position_embeddings=32))


def tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER))


FOLDERS = {
    "attnres": (lambda: AttnResForCausalLM(AttnResConfig(**TINY_DECODER)), "model_type 'attnres'.*AttnResForCausalLM"),
    "bert": (lambda: tiny_bert(), "model_type 'bert'.*BertForMaskedLM"),
    "moda": (lambda: MoDAForCausalLM(MoDAConfig(**TINY_DECODER)), "model_type 'moda'.*MoDAForCausalLM"),
    "denseformer": (lambda: DenseFormerForCausalLM(DenseFormerConfig(**TINY_DECODER)),
                    "model_type 'denseformer'.*DenseFormerForCausalLM"),
}


@pytest.mark.parametrize("convert", CONVERTERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("kind", sorted(FOLDERS))
def test_a_saved_non_llama_folder_is_refused_naming_its_model_type(kind, convert, tmp_path):
    build, message = FOLDERS[kind]
    build().save_pretrained(tmp_path / kind)
    with pytest.raises(ValueError, match=message) as info:
        convert(tmp_path / kind)
    assert "expected a LlamaForCausalLM" in str(info.value) and str(tmp_path / kind) in str(info.value)


@pytest.mark.parametrize("convert", CONVERTERS, ids=lambda f: f.__name__)
def test_a_config_only_bert_folder_is_refused_before_any_weight_is_read(convert, tmp_path):
    tiny_bert().config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'bert'"):
        convert(tmp_path)


@pytest.mark.parametrize("convert", CONVERTERS, ids=lambda f: f.__name__)
def test_a_llama_config_without_weights_is_an_error_naming_the_folder(convert, tmp_path):
    LlamaConfig(**TINY_DECODER).save_pretrained(tmp_path)
    with pytest.raises(OSError, match=str(tmp_path)):
        convert(tmp_path)


@pytest.mark.parametrize("convert", CONVERTERS, ids=lambda f: f.__name__)
def test_a_llama_checkpoint_missing_weights_is_refused_naming_them(convert, tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    dropped = "model.layers.1.mlp.up_proj.weight"
    del weights[dropped]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"lacks 1 Llama weight\(s\) \({dropped}\)"):
        convert(tmp_path)


@pytest.mark.parametrize("convert", CONVERTERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("kind", sorted(FOLDERS))
def test_a_non_llama_model_object_is_refused_naming_its_class(kind, convert):
    model = FOLDERS[kind][0]()
    with pytest.raises(ValueError, match=rf"got a {type(model).__name__} object \(model_type '{kind}'\)"):
        convert(model)


@pytest.mark.parametrize("convert", CONVERTERS, ids=lambda f: f.__name__)
def test_a_value_that_is_neither_model_nor_path_is_refused(convert):
    with pytest.raises(ValueError, match="got int"):
        convert(42)


@pytest.mark.parametrize("convert", CONVERTERS, ids=lambda f: f.__name__)
def test_a_real_llama_folder_still_converts_with_every_weight(convert, tmp_path):
    llama = tiny_llama().eval()
    llama.save_pretrained(tmp_path)
    model = convert(tmp_path)
    state = model.state_dict()
    for name, tensor in llama.state_dict().items():
        assert torch.equal(state[name], tensor), name
