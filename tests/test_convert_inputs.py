"""llama_to_denseformer / llama_to_moda / llama_to_attnres refuse what is not a Llama checkpoint, naming what
they found, instead of returning a randomly initialised model with load warnings; and keep what they convert: the
Llama's generation config, special token ids and dtype (and, saved alongside, its tokenizer's special tokens and
chat template)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

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
    message = str(info.value)
    assert "expected the causal LM of a supported backbone" in message and str(tmp_path / kind) in message


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
    with pytest.raises(ValueError, match=rf"has a llama config but lacks 1 of its weight\(s\) \({dropped}\)"):
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


# A Llama-3-style setup: two end tokens (end of text, end of turn), a repetition penalty, a pad id, bfloat16 weights.
SPECIAL = dict(bos_token_id=1, eos_token_id=[2, 7], pad_token_id=0)


def llama_with_settings(dtype: torch.dtype) -> LlamaForCausalLM:
    llama = LlamaForCausalLM(LlamaConfig(**(TINY_DECODER | SPECIAL))).to(dtype)
    llama.generation_config = GenerationConfig(**SPECIAL, repetition_penalty=1.3, max_new_tokens=9, do_sample=True,
                                               top_k=7)
    return llama.eval()


def generation_settings(model) -> dict:
    return {k: v for k, v in model.generation_config.to_dict().items() if k != "transformers_version"}


@pytest.mark.parametrize("convert", CONVERTERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("source", ["object", "folder"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_conversion_keeps_the_generation_config_special_tokens_and_dtype(convert, source, dtype, tmp_path):
    llama = llama_with_settings(dtype)
    if source == "folder":
        llama.save_pretrained(tmp_path)
    model = convert(llama if source == "object" else tmp_path)
    assert generation_settings(model) == generation_settings(llama)  # before: eos 2 only, no penalty
    assert model.generation_config.eos_token_id == [2, 7] and model.generation_config.repetition_penalty == 1.3
    assert {k: getattr(model.config, k) for k in SPECIAL} == SPECIAL
    assert {p.dtype for p in model.parameters()} == {dtype} and model.config.dtype == dtype


@pytest.mark.parametrize("convert", CONVERTERS, ids=lambda f: f.__name__)
def test_a_converted_model_saved_with_the_llamas_tokenizer_keeps_all_of_it(convert, tmp_path):
    from depthfusion_hf.data.corpus import load_kjv_chapters, train_bpe_tokenizer
    from depthfusion_hf.export import save_remote_code_folder

    tokenizer = train_bpe_tokenizer(load_kjv_chapters()[:5], vocab_size=TINY_DECODER["vocab_size"] + 300)
    tokenizer.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|eot|>{% endfor %}"
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    vocab = len(tokenizer)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id, vocab - 1],
               pad_token_id=tokenizer.pad_token_id)
    llama = LlamaForCausalLM(LlamaConfig(**(TINY_DECODER | {"vocab_size": vocab} | ids))).to(torch.bfloat16)
    llama.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, vocab - 1],
                                               repetition_penalty=1.3)
    llama.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    model = convert(tmp_path / "llama")
    save_remote_code_folder(model, tmp_path / "out", tokenizer=AutoTokenizer.from_pretrained(tmp_path / "llama"))
    saved = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert saved.chat_template == tokenizer.chat_template and saved.get_vocab() == tokenizer.get_vocab()
    assert saved.all_special_tokens == tokenizer.all_special_tokens
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert loaded.generation_config.eos_token_id == [tokenizer.eos_token_id, vocab - 1]
    assert loaded.generation_config.repetition_penalty == 1.3
    assert loaded.config.dtype == torch.bfloat16
