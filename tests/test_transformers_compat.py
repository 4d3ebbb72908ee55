"""The installed transformers' KV-cache keyword (``transformers_compat``): every layer of every causal family fills the
cache in a cached forward, silently and on every supported transformers (CI runs this file on the newest and on the
oldest, ``scripts/setup_old_transformers.sh``). A layer call spelled the other way fails here: on 5.16-5.23 a Llama
layer drops ``cache=`` into its ``**kwargs`` (the cache stays empty), on 5.24+ ``past_key_values=`` warns."""

import warnings

import pytest
import torch
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from depthfusion_hf import AttnResForCausalLM, DenseFormerForCausalLM, MHCForCausalLM
from depthfusion_hf.models import transformers_compat
from depthfusion_hf.models.transformers_compat import CACHE_KWARG, accepts_cache, cache_kwarg, output_cache
from tests.attnres.helpers import randomise_attnres
from tests.attnres.helpers import tiny_config as attnres_config
from tests.causal_lm_checks import TINY_DECODER
from tests.denseformer.helpers import randomise_dwa
from tests.denseformer.helpers import tiny_config as denseformer_config
from tests.mhc.helpers import randomise_mhc
from tests.mhc.helpers import tiny_config as mhc_config
from tests.moda.helpers import tiny_model as moda_model

OTHER_KWARG = {"cache": "past_key_values", "past_key_values": "cache"}[CACHE_KWARG]


def denseformer():
    model = DenseFormerForCausalLM(denseformer_config(dwa_dilation=2))
    randomise_dwa(model)
    return model


def attnres():
    model = AttnResForCausalLM(attnres_config(attnres_block_size=2))
    randomise_attnres(model)
    return model


FAMILIES = {
    "denseformer": denseformer,
    "moda": lambda: moda_model(moda_ffn_kv=True),
    "attnres": attnres,
    "mhc": lambda: randomise_mhc(MHCForCausalLM(mhc_config(hc_mult=4))),
}


def tiny_llama_layer() -> tuple[LlamaDecoderLayer, LlamaConfig]:
    config = LlamaConfig(**TINY_DECODER, num_hidden_layers=1)
    return LlamaDecoderLayer(config, layer_idx=0).eval(), config


def call_llama_layer(keyword: str) -> DynamicCache:
    """A 5-token prefill through one transformers Llama layer, its cache passed as ``keyword``: the cache after it."""
    layer, config = tiny_llama_layer()
    hidden = torch.randn(1, 5, config.hidden_size)
    position_ids = torch.arange(5).unsqueeze(0)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        layer(hidden, position_embeddings=LlamaRotaryEmbedding(config)(hidden, position_ids), position_ids=position_ids,
              use_cache=True, **{keyword: cache})
    return cache


def test_the_chosen_keyword_is_the_one_a_llama_layer_honours():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert call_llama_layer(CACHE_KWARG).get_seq_length() == 5


def test_the_other_keyword_is_lost_or_deprecated():
    """Why the keyword is chosen in one place: the other spelling is dropped silently (5.16-5.23) or warns (5.24+)."""
    if OTHER_KWARG == "cache":  # transformers < 5.24: swallowed by **kwargs, nothing said
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert call_llama_layer(OTHER_KWARG).get_seq_length() == 0
    else:
        with pytest.warns(FutureWarning, match="past_key_values"):
            assert call_llama_layer(OTHER_KWARG).get_seq_length() == 5


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_fills_the_cache_and_decodes_like_the_full_forward(family):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    ids = torch.randint(3, TINY_DECODER["vocab_size"], (2, 7))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the keyword of the installed version: nothing deprecated
        full = model(ids).logits
        cache = output_cache(model(ids[:, :5], use_cache=True))
        lengths = [layer.get_seq_length() for layer in cache.layers]
        assert lengths == [5] * model.config.num_hidden_layers, f"cached tokens per layer: {lengths}"
        step = model(ids[:, 5:], use_cache=True, **cache_kwarg(cache)).logits
    assert [layer.get_seq_length() for layer in cache.layers] == [7] * len(lengths)
    torch.testing.assert_close(step, full[:, 5:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["denseformer", "mhc"])
def test_generate_warns_nothing(family):
    """``generate`` (which passes the installed version's keyword down) runs without a FutureWarning."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    ids = torch.randint(3, TINY_DECODER["vocab_size"], (1, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert output_cache(out).get_seq_length() == 6  # the prompt and two fed-back tokens


def test_accepts_cache_takes_either_name():
    @accepts_cache
    def forward(cache=None):
        return cache

    first, second = DynamicCache(), DynamicCache()
    assert forward(cache=first) is first
    if CACHE_KWARG == "past_key_values":  # the name that version's transformers passes: no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert forward(past_key_values=first) is first
            assert forward(past_key_values=None, cache=first) is first  # as LlamaForCausalLM passes a user's cache=
        with pytest.raises(ValueError, match="two different caches"):
            forward(past_key_values=first, cache=second)
    else:  # transformers' deprecated alias
        with pytest.warns(FutureWarning, match="past_key_values"):
            assert forward(past_key_values=first) is first


def test_disagreeing_spellings_are_refused(monkeypatch):
    """A transformers whose APIs name the cache differently gets an ImportError, not a guess."""
    fields = dict(transformers_compat.BaseModelOutputWithPast.__dataclass_fields__)
    fields[OTHER_KWARG] = fields.pop(CACHE_KWARG)
    monkeypatch.setattr(transformers_compat.BaseModelOutputWithPast, "__dataclass_fields__", fields)
    with pytest.raises(ImportError, match="names the KV cache differently"):
        transformers_compat.installed_cache_kwarg()
