"""The models ``bench_models.py`` measures: names, how each is built, and which pairs compute the same function.

A name is ``<base>[-ckpt][-before]``:

- ``<base>``: ``llama``, ``llama-control`` (a second, identical Llama: the run's noise floor), or a family model
  named after its study spec (:mod:`depthfusion_hf.recipes.study.specs`, one name, one meaning): ``denseformer-1x1``
  (``denseformer:1x1``), ``denseformer-4x5``, ``moda``, ``moda-noffn`` (``moda:no-ffn-kv``), ``moda-w<W>``
  (``moda:moda_depth_window=W``), ``attnres-full``, ``attnres-block8`` (``attnres:block8``: 8 blocks, 2L/8
  sub-layers each), ``mhc`` (4 streams);
- ``-ckpt``: activation (gradient) checkpointing on every decoder layer (transformers' non-reentrant default);
- ``-before``: the family folder of another checkout (``--before``), imported as ``<family>_before``.

Every model gets the same Llama fields (:func:`common_fields`) and the family fields of its spec at that depth; the
family classes are the registry's (:data:`depthfusion_hf.families.FAMILIES`), or the same-named classes of the other
checkout's folder. The old names ``moda-before-noffn`` and ``moda-before-ckpt`` are read as ``moda-noffn-before`` and
``moda-ckpt-before``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from depthfusion_hf.families import FAMILIES
from depthfusion_hf.recipes.study.specs import parse_model_spec

LLAMAS = ("llama", "llama-control")
FAMILY_MODELS = {  # bench name -> study spec
    "denseformer-1x1": "denseformer:1x1",
    "denseformer-4x5": "denseformer:4x5",
    "attnres-full": "attnres:full",
    "attnres-block8": "attnres:block8",
    "moda": "moda",
    "moda-noffn": "moda:no-ffn-kv",
    "mhc": "mhc",  # hc_mult 4 (the family default, DeepSeek-V4's)
}
ALIASES = {"moda-before-noffn": "moda-noffn-before", "moda-before-ckpt": "moda-ckpt-before"}
_WINDOW = re.compile(r"moda-w(\d+)")


@dataclass(frozen=True)
class ModelName:
    """A parsed model name: its base, and whether it is checkpointed and from the other checkout."""

    base: str
    ckpt: bool = False
    before: bool = False

    @property
    def text(self) -> str:
        """The canonical name, ``<base>[-ckpt][-before]``."""
        return self.base + ("-ckpt" if self.ckpt else "") + ("-before" if self.before else "")

    @property
    def spec(self) -> str | None:
        """The study spec of the base (``None`` for the Llamas)."""
        if self.base in LLAMAS:
            return None
        window = _WINDOW.fullmatch(self.base)
        return f"moda:moda_depth_window={window[1]}" if window else FAMILY_MODELS[self.base]

    @property
    def kind(self) -> str:
        """``"llama"`` or the family's ``model_type``."""
        return "llama" if self.spec is None else self.spec.partition(":")[0]


def parse_name(text: str) -> ModelName:
    """Parse ``<base>[-ckpt][-before]`` (old aliases accepted).

    Raises:
        ValueError: an unknown base, or ``-before`` of a Llama (transformers' Llama is the same in both checkouts).
    """
    text = ALIASES.get(text.strip(), text.strip())
    before = text.endswith("-before")
    text = text.removesuffix("-before")
    ckpt = text.endswith("-ckpt")
    base = text.removesuffix("-ckpt")
    if base not in LLAMAS and base not in FAMILY_MODELS and not _WINDOW.fullmatch(base):
        known = [*LLAMAS, *FAMILY_MODELS, "moda-w<W>"]
        raise ValueError(f"unknown model {text!r}: the base must be one of {known}, then -ckpt and/or -before")
    if before and base in LLAMAS:
        raise ValueError(f"{base}-before: the Llama is transformers' own, the same in both checkouts")
    return ModelName(base, ckpt, before)


def default_names(window: int, before_families: Mapping[str, ModuleType]) -> list[str]:
    """Every model when ``--models`` is not given: the Llamas (and ``llama-ckpt``), every family model, ``moda-ckpt``,
    ``moda-w<window>``, and with ``--before`` each family model of the other checkout and ``moda-ckpt-before``."""
    names = [*LLAMAS, "llama-ckpt", *FAMILY_MODELS, "moda-ckpt", f"moda-w{window}"]
    for base in FAMILY_MODELS:
        if parse_name(base).kind in before_families:
            names.append(f"{base}-before")
    if "moda" in before_families:
        names.append("moda-ckpt-before")
    return names


def common_fields(layers: int, hidden: int, intermediate: int, vocab: int, seq: int, kv_heads: int | None) -> dict:
    """The Llama fields every model shares (heads of 64; MHA unless ``kv_heads``)."""
    return dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                num_attention_heads=hidden // 64, num_key_value_heads=kv_heads or hidden // 64, vocab_size=vocab,
                max_position_embeddings=max(1024, seq * 2), pad_token_id=0, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False)


def builder(name: ModelName, common: dict, before_families: Mapping[str, ModuleType],
            backbone: str = "llama") -> Callable[[], torch.nn.Module]:
    """A function building the model ``name`` (fresh weights from the current torch seed). With ``backbone`` other
    than ``"llama"``: the Llamas are that backbone's own causal LM, and the families are built on it
    (``backbone_config``), all with the ``common`` sizes (heads of 64: ``head_dim`` 64).

    Raises:
        ValueError: the spec has no model at this depth, ``-before`` of a family the other checkout lacks (or on
            another backbone), or a family that does not support ``backbone`` (naming the ones it does).
    """
    backbone_config = None if backbone == "llama" else CONFIG_MAPPING[backbone](**common, head_dim=64)
    if name.spec is None:
        config_class, model_class = LlamaConfig, LlamaForCausalLM
        fields = {}
    else:
        fields = parse_model_spec(name.spec).fields_at(common["num_hidden_layers"])
        family = FAMILIES[name.kind]
        config_class, model_class = family.config_class, family.task_model_class
        if backbone not in config_class.supported_backbones:
            raise ValueError(f"{name.kind} supports the backbones {list(config_class.supported_backbones)}")
        if name.before:
            if name.kind not in before_families or backbone_config is not None:
                raise ValueError(f"{name.text}: no {name.kind} folder loaded from --before (or not on {backbone})")
            folder = before_families[name.kind]
            config_class = getattr(folder, config_class.__name__)
            model_class = getattr(folder, model_class.__name__)

    def build() -> torch.nn.Module:
        if backbone_config is None:
            model = model_class(config_class(**common, **fields))
        elif name.spec is None:
            model = AutoModelForCausalLM.from_config(copy.deepcopy(backbone_config))
        else:
            model = model_class(config_class(backbone_config=copy.deepcopy(backbone_config), **fields))
        if name.ckpt:
            model.activation_checkpointing_enable()
        return model

    return build


def same_function_pairs(names: list[str]) -> list[tuple[str, str]]:
    """The pairs among ``names`` that compute the same function: each model and its ``-before``, each ``-ckpt``
    model and the same model without checkpointing."""
    present = set(names)
    pairs = []
    for text in names:
        name = parse_name(text)
        if not name.before and f"{text}-before" in present:
            pairs.append((text, f"{text}-before"))
        if name.ckpt:
            plain = ModelName(name.base, False, name.before).text
            if plain in present:
                pairs.append((text, plain))
    return pairs


__all__ = ["ALIASES", "FAMILY_MODELS", "LLAMAS", "ModelName", "builder", "common_fields", "default_names",
           "parse_name", "same_function_pairs"]
