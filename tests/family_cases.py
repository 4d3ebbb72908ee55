"""What the behaviour tests need to know about each causal-LM family: one :class:`FamilyCase` per family.

The behaviour tests (``test_generation.py``, ``test_compiled_decoding.py``, ``test_remote_code_and_convert.py``,
``test_sharded_parameters.py``, ``test_create_graph_dependent_inputs.py``, ``test_torch_compile.py``) run over every
causal family of the registry (:func:`depthfusion_hf.families.causal_lm_families`) and read its entry here: the
tiny model, the variants each behaviour runs, the files of its remote-code folder, its Llama conversion and that
conversion's bound. A family in the registry without an entry fails collection (``KeyError`` naming it): adding a
family adds an entry here, not test files. DWAtt (token classification) has its own tests (``tests/dwatt/``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from transformers import CONFIG_MAPPING, LlamaConfig, PretrainedConfig, PreTrainedModel

from depthfusion_hf.families import causal_lm_families, get_family
from depthfusion_hf.models.configuration_decoder import MIRRORED_FIELDS
from tests.attnres import helpers as attnres
from tests.denseformer import helpers as denseformer
from tests.mhc import helpers as mhc
from tests.moda import helpers as moda


@dataclass(frozen=True)
class Conversion:
    """One Llama -> family conversion (``Family.from_llama``) and its bound.

    Attributes:
        kwargs: the conversion's keyword arguments (config fields of the family).
        llama: ``LlamaConfig`` fields beyond the tiny decoder's.
        dtype: the Llama's dtype.
        llama_noise: std of the noise added to every Llama weight (0: transformers' init).
        atol, rtol: the bound ``max |logits - Llama's| <= atol + rtol * max |Llama's logits|``.
    """

    kwargs: dict
    atol: float
    rtol: float = 0.0
    llama: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    llama_noise: float = 0.0


@dataclass(frozen=True)
class FamilyCase:
    """A causal family's tiny model and the variants each behaviour test runs (variant id -> config fields).

    Attributes:
        tiny_config: config fields -> the family's tiny config (the tiny decoder of ``tests/causal_lm_checks.py``:
            GQA 4 / 2 heads, width 48, vocabulary 97 with ids 0-2 pad / bos / eos; the family's layer count).
        tiny_llama_config: config fields -> the Llama config of the same shape.
        randomise: (model, seed) -> moves the family's own parameters off their init (an identity init would
            hide a wrong path).
        generation: cached generation equals uncached (``test_generation.py``).
        compiled_decoding: compiled static-cache decoding equals eager (``test_compiled_decoding.py``).
        remote_code: a saved folder loads in a fresh process (``test_remote_code_and_convert.py``).
        sharding: FSDP2-sharded equals plain (``test_sharded_parameters.py``).
        torch_compile: ``torch.compile`` gives the eager numbers, at 4 layers (``test_torch_compile.py``; one variant
            on another backbone);
            ``compiled_generate`` names the variant that also decodes and generates compiled.
        op_files: the family's op modules a saved folder holds beside ``configuration_``/``modeling_<family>.py``.
        analysis: a Python expression over ``model`` and ``ids`` giving the family's analysis weights (a tensor),
            compared after loading; None when the family has none that take ids.
        conversions: Llama conversions (id -> :class:`Conversion`).
        conversion_rejects: (conversion kwargs, error message pattern) pairs the conversion rejects.
        paths: other forward paths that the tiny shapes do not take by default (id -> monkeypatch setter).
    """

    tiny_config: Callable[..., PretrainedConfig]
    tiny_llama_config: Callable[..., LlamaConfig]
    randomise: Callable[[PreTrainedModel, int], object]
    generation: dict[str, dict]
    compiled_decoding: dict[str, dict]
    remote_code: dict[str, dict]
    sharding: dict[str, dict]
    torch_compile: dict[str, dict]
    compiled_generate: str
    op_files: tuple[str, ...]
    conversions: dict[str, Conversion]
    conversion_rejects: tuple[tuple[dict, str], ...] = ()
    analysis: str | None = None
    paths: dict[str, Callable[[pytest.MonkeyPatch], None]] = field(default_factory=dict)


CASES: dict[str, FamilyCase] = {
    "denseformer": FamilyCase(
        tiny_config=denseformer.tiny_config,
        tiny_llama_config=denseformer.tiny_llama_config,
        randomise=lambda model, seed: denseformer.randomise_dwa(model, seed),
        # 2x1: a DWA step after every second block; 1x1: after every block over all earlier outputs; 2x2: every
        # second block, every second output.
        generation={"2x1": dict(dwa_dilation=2, dwa_period=1), "qwen3": dict(backbone="qwen3")},
        compiled_decoding={"1x1": dict(num_hidden_layers=4),
                           "2x2": dict(num_hidden_layers=4, dwa_dilation=2, dwa_period=2)},
        remote_code={"2x2": dict(dwa_dilation=2, dwa_period=2)},
        sharding={"2x1": dict(dwa_dilation=2, dwa_period=1)},
        torch_compile={"2x1": dict(dwa_dilation=2, dwa_period=1), "qwen3": dict(backbone="qwen3")},
        compiled_generate="2x1",
        op_files=("dwa.py",),
        analysis="model.dwa_weights()",
        conversions={f"{k}x{p}": Conversion(dict(dwa_dilation=k, dwa_period=p), atol=1e-5)
                     for k, p in ((1, 1), (4, 5), (2, 3))},
    ),
    "moda": FamilyCase(
        tiny_config=moda.tiny_config,
        tiny_llama_config=moda.tiny_llama_config,
        randomise=lambda model, seed: moda.sharpen_attention(model),
        generation={"pre": dict(norm_position="pre"), "post": dict(norm_position="post"),
                    "qwen3": dict(backbone="qwen3")},
        # FFN-side entries on and off (off: layer 1 reads one key and one value, a pair of entries that
        # torch.compile 2.13 mis-binds in an autograd.Function called under no_grad).
        compiled_decoding={"default": dict(num_hidden_layers=2),
                           "no-ffn-kv": dict(num_hidden_layers=2, moda_ffn_kv=False)},
        remote_code={"post": dict(norm_position="post")},
        sharding={"default": {}},
        torch_compile={"default": {}, "no-ffn-kv": dict(moda_ffn_kv=False), "qwen3": dict(backbone="qwen3")},
        compiled_generate="default",
        op_files=("moda_attention.py", "moda_torch.py"),
        # Closed depth gates (the default): MoDA == Llama. Ungated, one layer reads no depth entry (and the last layer
        # writes no FFN entry): MoDA == Llama too.
        conversions={"gated": Conversion({}, atol=1e-5),
                     "one-layer-ungated": Conversion(dict(depth_gate=False), atol=1e-5,
                                                     llama=dict(num_hidden_layers=1))},
        conversion_rejects=((dict(ffn_kv_init="random"), "ffn_kv_init must be one of"),
                            (dict(norm_position="post"), "norm_position must be 'pre'")),
    ),
    "attnres": FamilyCase(
        tiny_config=attnres.tiny_config,
        tiny_llama_config=attnres.tiny_llama_config,
        randomise=lambda model, seed: attnres.randomise_attnres(model, seed),
        # full: every call over all earlier sub-layer outputs; block 3: blocks end mid-layer.
        generation={"full": {}, "block3": dict(attnres_block_size=3), "gemma3": dict(backbone="gemma3_text")},
        compiled_decoding={"full": dict(num_hidden_layers=2), "block3": dict(num_hidden_layers=2,
                                                                             attnres_block_size=3)},
        remote_code={"full": {}, "block3": dict(attnres_block_size=3)},
        sharding={"full": {}, "block2": dict(attnres_block_size=2)},
        torch_compile={"full": {}, "block3": dict(attnres_block_size=3), "gemma3": dict(backbone="gemma3_text")},
        compiled_generate="block3",
        op_files=("attnres.py",),
        analysis="model.depth_attention_weights(ids)",
        # Uniform averaging is the residual sum / N and the pre-norms undo the scale: only RMSNorm's eps differs,
        # so with eps -> 0 the converted model gives the Llama's logits.
        conversions={name: Conversion(dict(attnres_block_size=block), atol=1e-5, llama=dict(rms_norm_eps=1e-12))
                     for name, block in (("full", None), ("block2", 2), ("block3", 3))},
        conversion_rejects=((dict(attnres_block_size=9), r"`attnres_block_size` must be an integer in \[1, 8\]"),),
        # The torch backend's forward over the list of sources (training sizes) instead of the stacked one that
        # the tiny shapes take.
        paths={"list": lambda monkeypatch: attnres.set_small_numel(monkeypatch, -1)},
    ),
    "mhc": FamilyCase(
        tiny_config=mhc.tiny_config,  # n = 4 streams
        tiny_llama_config=mhc.tiny_llama_config,
        randomise=lambda model, seed: mhc.randomise_mhc(model, seed),
        generation={"n1": dict(hc_mult=1), "n4": dict(hc_mult=4), "olmo2": dict(backbone="olmo2")},
        compiled_decoding={"n4": dict(num_hidden_layers=2)},  # 20 Sinkhorn iterations unrolled in the graph
        remote_code={"n4": dict(hc_mult=4)},
        # every parameter sharded, the hyper-connections' odd-sized ones (scale [3], hc_scale [1]) too
        sharding={"n4": {}},
        torch_compile={"n4": dict(hc_sinkhorn_iters=3), "olmo2": dict(hc_sinkhorn_iters=3, backbone="olmo2")},
        compiled_generate="n4",
        op_files=("mhc_connection.py", "mhc_mix.py", "mhc_inputs.py", "mhc_triton.py"),
        analysis="model.hyper_connection_weights(ids)['comb']",
        # The bound llama_to_mhc's docstring states: 2e-6 of the logits' scale, float64 and float32, on a Llama
        # whose weights are moved off their init (measured: at most 1.7e-7 in float64, 6e-7 in float32).
        conversions={f"n{n}-{name}": Conversion(dict(hc_mult=n), atol=0.0, rtol=2e-6, dtype=dtype, llama_noise=0.05)
                     for n in (1, 2, 4) for name, dtype in (("fp64", torch.float64), ("fp32", torch.float32))},
        conversion_rejects=((dict(hc_mult=0), "`hc_mult` must be an integer >= 1"),
                            (dict(post_spread=1.0), r"post_spread must be a number in \[0, 1\)"),
                            (dict(hc_mult=4, hc_eps=0.3), r"hc_eps \(0.3\) must be < 1 / hc_mult")),
    ),
}


def tiny_model(family: str, seed: int = 0, backbone: str | None = None, **overrides) -> PreTrainedModel:
    """The family's tiny model in eval mode: initialised under ``torch.manual_seed(seed)``, then its own parameters
    moved off their init (seeded ``seed + 1``). ``backbone`` (issue 30): built on that decoder at the same sizes."""
    torch.manual_seed(seed)
    config = CASES[family].tiny_config(**overrides)
    if backbone is not None:
        sizes = {name: getattr(config, name) for name in MIRRORED_FIELDS if getattr(config, name) is not None}
        config = CASES[family].tiny_config(**overrides, backbone_config=CONFIG_MAPPING[backbone](**sizes))
    model = get_family(family).task_model_class(config).eval()
    CASES[family].randomise(model, seed + 1)
    return model


def params(behaviour: str) -> list:
    """``pytest.param(family, variant config fields, id="family-variant")`` for every causal family's variants of
    ``behaviour`` (a :class:`FamilyCase` field)."""
    return [pytest.param(family, overrides, id=f"{family}-{variant}")
            for family in causal_lm_families() for variant, overrides in getattr(CASES[family], behaviour).items()]


def path_params() -> list:
    """``pytest.param(family, path setter or None, id=...)``: each causal family on its default path and on every
    other path of its entry."""
    return [pytest.param(family, setter, id=f"{family}-{name}") for family in causal_lm_families()
            for name, setter in {"default": None, **CASES[family].paths}.items()]
