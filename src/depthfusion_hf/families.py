"""The registry of model families: one :class:`Family` entry per family, keyed by ``model_type``.

Everything the package needs to know about a family outside its own folder lives in its entry: the
config and model classes and the Auto class that loads them, the Hub pipeline tag and model-card
template, the training script's command-line options, a display name for a variant, the analysis
plot of the main job and the Llama upcycling function. The package's ``__init__`` registers the Auto
classes from it; the causal-LM recipe, ``scripts/train_clm.py``, ``scripts/push_to_hub.py`` and the
export modules read it. Adding a family means writing ``models/<family>/`` and one entry in
:data:`FAMILIES` (see docs/ARCHITECTURE.md, "How to add a family").
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from . import convert, plotting, plotting_attnres, plotting_mhc
from .models.modeling_attnres import AttnResForCausalLM, AttnResModel
from .models.modeling_denseformer import DenseFormerForCausalLM, DenseFormerModel
from .models.modeling_dwatt import DWAttForTokenClassification
from .models.modeling_mhc import MHCForCausalLM, MHCModel
from .models.modeling_moda import MoDAForCausalLM, MoDAModel

AUTO_CLASSES = {"text-generation": AutoModelForCausalLM, "token-classification": AutoModelForTokenClassification}
# An analysis plot: (trained model, output folder, one validation sequence [1, T], run label) -> file written.
AnalysisPlot = Callable[[PreTrainedModel, Path, torch.Tensor, str], Path]


@dataclass(frozen=True)
class Family:
    """What the package knows about one model family (its folder is ``models/<model_type>/``).

    Attributes:
        model_type: the config's ``model_type`` (the registry key, the CLI ``--model``, the card template's name
            ``model_cards/<model_type>.md``).
        title: the family's name in prose (``"DenseFormer"``).
        task_model_class: the model a user trains and exports (``...ForCausalLM``, ``...ForTokenClassification``);
            its ``config_class`` is the family's config.
        base_model_class: the headless model for ``AutoModel``; ``None`` when the family has none (DWAtt
            wraps a transformers encoder).
        variant_name: config -> short display name of the variant (``"denseformer 4x5"``); results tables use it.
        card_values: model -> the family's numbers for its card template (see ``model_card.model_card_values``).
        pipeline_tag: the Hub pipeline tag of an export; it decides the Auto class (:data:`AUTO_CLASSES`).
        default_dataset: the dataset id a card names when the caller gives none (the reference run's data).
        add_cli_options: adds the family's options to ``scripts/train_clm.py``'s parser (causal LMs only).
        config_kwargs: parsed arguments -> the family's config fields (the inverse of ``add_cli_options``).
        analysis_plot: the figure the main job draws for a trained model, or ``None``.
        from_llama: upcycles a ``LlamaForCausalLM`` (object, folder or Hub id; config fields as keyword
            arguments) into this family, or ``None``.
    """

    model_type: str
    title: str
    task_model_class: type[PreTrainedModel]
    base_model_class: type[PreTrainedModel] | None
    variant_name: Callable[[PretrainedConfig], str]
    card_values: Callable[[PreTrainedModel], dict[str, Any]]
    pipeline_tag: str = "text-generation"
    default_dataset: str = "kjv"
    add_cli_options: Callable[[argparse.ArgumentParser], None] | None = None
    config_kwargs: Callable[[argparse.Namespace], dict[str, Any]] | None = None
    analysis_plot: AnalysisPlot | None = None
    from_llama: Callable[..., PreTrainedModel] | None = None

    @property
    def config_class(self) -> type[PretrainedConfig]:
        return self.task_model_class.config_class

    @property
    def task_auto_class(self) -> type:
        """The transformers Auto class that loads ``task_model_class``."""
        return AUTO_CLASSES[self.pipeline_tag]

    @property
    def card_template(self) -> str:
        """The model-card template's file name in ``model_cards/``."""
        return f"{self.model_type}.md"

    @property
    def is_causal_lm(self) -> bool:
        """True for decoder families trained by the causal-LM recipe (``scripts/train_clm.py``)."""
        return self.task_auto_class is AutoModelForCausalLM


# ---------------------------------------------------------------------------------------------------
# Per-family pieces (kept short: the logic they call lives in the family folder, convert.py, plotting.py)
# ---------------------------------------------------------------------------------------------------


def _decoder_card_values(config: PretrainedConfig) -> dict[str, Any]:
    """The Llama-shape numbers every decoder card shows."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return dict(
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
    )


def _given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The family options the command line set explicitly (they are ``argparse.SUPPRESS``-defaulted), so that
    a field the user did not give comes from the ``--config`` file, else from the config class default."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def _denseformer_cli(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("denseformer")
    group.add_argument("--dwa_dilation", type=int, default=argparse.SUPPRESS, help="DenseFormer k (default 1)")
    group.add_argument("--dwa_period", type=int, default=argparse.SUPPRESS, help="DenseFormer p (default 1)")


def _denseformer_card_values(model: PreTrainedModel) -> dict[str, Any]:
    config = model.config
    layers = config.num_hidden_layers
    return _decoder_card_values(config) | dict(
        dwa_dilation=config.dwa_dilation,
        dwa_period=config.dwa_period,
        num_dwa_weights=model.model.dwa.alphas.numel(),
        dwa_weights_shape=f"[{layers}, {layers + 1}]",
    )


def _moda_cli(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("moda")
    group.add_argument("--moda_ffn_kv", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                       help="MoDA FFN-side depth KV projection (default on)")
    group.add_argument("--norm_position", choices=["pre", "post"], default=argparse.SUPPRESS,
                       help="MoDA norm placement (default pre)")


def _moda_name(config: PretrainedConfig) -> str:
    """``"moda"`` for the default variant (FFN-side K/V, pre-norm); other choices are appended."""
    parts = ["moda"]
    if not config.moda_ffn_kv:
        parts.append("no-ffn-kv")
    if config.norm_position != "pre":
        parts.append(f"{config.norm_position}-norm")
    return " ".join(parts)


def _moda_card_values(model: PreTrainedModel) -> dict[str, Any]:
    config = model.config
    return _decoder_card_values(config) | dict(
        moda_ffn_kv=config.moda_ffn_kv,
        norm_position=config.norm_position,
        max_depth_entries=(2 if config.moda_ffn_kv else 1) * (config.num_hidden_layers - 1),
        depth_entries_note=(
            "each earlier layer's attention K/V plus one FFN-side K/V pair projected from its FFN input"
            if config.moda_ffn_kv else "each earlier layer's attention K/V, reused without new parameters"
        ),
    )


def _attnres_block_size(text: str) -> int | None:
    """``--attnres_block_size``: an integer S (block AttnRes) or ``none`` / ``full`` (full AttnRes)."""
    return None if text.lower() in ("none", "full") else int(text)


def _attnres_cli(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("attnres")
    group.add_argument("--attnres_block_size", type=_attnres_block_size, default=argparse.SUPPRESS,
                       help="AttnRes: sub-layers per block (block AttnRes); 'full' or omitted: full AttnRes")


def _attnres_name(config: PretrainedConfig) -> str:
    """``"attnres full"`` or ``"attnres block 4"`` (blocks of 4 sub-layers)."""
    block = config.attnres_block_size
    return "attnres full" if block is None else f"attnres block {block}"


def _attnres_card_values(model: PreTrainedModel) -> dict[str, Any]:
    config = model.config
    block = config.attnres_block_size
    if block is None:
        variant = "full AttnRes, every sub-layer reads the embedding and every earlier sub-layer output"
    else:
        variant = (f"block AttnRes, {config.num_blocks} blocks of {block} sub-layers; a sub-layer reads the "
                   "embedding, the earlier blocks' sums and the running sum of its own block")
    return _decoder_card_values(config) | dict(
        attnres_block_size=block,
        attnres_variant=variant,
        attnres_variant_short="full" if block is None else f"block {block}",
        num_sublayers=config.num_sublayers,
        num_sources=config.num_blocks + 1,
        num_attnres_params=f"{2 * config.num_sublayers * config.hidden_size:,}",
        depth_weights_shape=f"[{config.num_sublayers + 1}, {config.num_blocks + 1}]",
    )


def _mhc_cli(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mhc")
    group.add_argument("--hc_mult", type=int, default=argparse.SUPPRESS, help="mHC: residual streams n (default 4)")
    group.add_argument("--hc_sinkhorn_iters", type=int, default=argparse.SUPPRESS,
                       help="mHC: Sinkhorn-Knopp iterations of comb (default 20)")
    group.add_argument("--hc_eps", type=float, default=argparse.SUPPRESS, help="mHC: hc_eps (default 1e-6)")


def _mhc_card_values(model: PreTrainedModel) -> dict[str, Any]:
    config = model.config
    layers, n = config.num_hidden_layers, config.hc_mult
    hc_params = sum(p.numel() for name, p in model.named_parameters() if "_hc." in name or "hc_head." in name)
    return _decoder_card_values(config) | dict(
        hc_mult=n,
        hc_sinkhorn_iters=config.hc_sinkhorn_iters,
        hc_eps=config.hc_eps,
        num_sublayers=2 * layers,
        num_hc_params=f"{hc_params:,}",
        weights_shape=f"[{layers}, 2, {n}]",
        comb_shape=f"[{layers}, 2, {n}, {n}]",
    )


def _dwatt_card_values(model: PreTrainedModel) -> dict[str, Any]:
    config = model.config
    backbone = config.backbone_config
    labels = [config.id2label[i] for i in sorted(config.id2label)]
    return dict(
        backbone_model_type=backbone.model_type,
        backbone_name=getattr(backbone, "_name_or_path", "") or backbone.model_type,
        num_hidden_layers=backbone.num_hidden_layers,
        hidden_size=backbone.hidden_size,
        fusion=config.fusion,
        num_labels=config.num_labels,
        labels=", ".join(f"`{label}`" for label in labels),
        num_states=config.num_states,
        fusion_num_params=f"{config.fusion_num_params():,}",
        depth_embedding_size=config.depth_embedding_size,
        bottleneck_ratio=config.bottleneck_ratio,
    )


# ---------------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------------

FAMILIES: Mapping[str, Family] = {
    family.model_type: family
    for family in (
        Family(
            model_type="denseformer",
            title="DenseFormer",
            task_model_class=DenseFormerForCausalLM,
            base_model_class=DenseFormerModel,
            variant_name=lambda config: f"denseformer {config.dwa_dilation}x{config.dwa_period}",
            card_values=_denseformer_card_values,
            add_cli_options=_denseformer_cli,
            config_kwargs=lambda args: _given(args, "dwa_dilation", "dwa_period"),
            analysis_plot=plotting.plot_denseformer_analysis,
            from_llama=convert.llama_to_denseformer,
        ),
        Family(
            model_type="moda",
            title="MoDA",
            task_model_class=MoDAForCausalLM,
            base_model_class=MoDAModel,
            variant_name=_moda_name,
            card_values=_moda_card_values,
            add_cli_options=_moda_cli,
            config_kwargs=lambda args: _given(args, "moda_ffn_kv", "norm_position"),
            analysis_plot=plotting.plot_moda_analysis,
            from_llama=convert.llama_to_moda,
        ),
        Family(
            model_type="attnres",
            title="AttnRes",
            task_model_class=AttnResForCausalLM,
            base_model_class=AttnResModel,
            variant_name=_attnres_name,
            card_values=_attnres_card_values,
            add_cli_options=_attnres_cli,
            config_kwargs=lambda args: _given(args, "attnres_block_size"),
            analysis_plot=plotting_attnres.plot_attnres_analysis,
            from_llama=convert.llama_to_attnres,
        ),
        Family(
            model_type="mhc",
            title="mHC",
            task_model_class=MHCForCausalLM,
            base_model_class=MHCModel,
            variant_name=lambda config: f"mhc n{config.hc_mult}",
            card_values=_mhc_card_values,
            add_cli_options=_mhc_cli,
            config_kwargs=lambda args: _given(args, "hc_mult", "hc_sinkhorn_iters", "hc_eps"),
            analysis_plot=plotting_mhc.plot_mhc_analysis,
            from_llama=convert.llama_to_mhc,
        ),
        Family(
            model_type="dwatt",
            title="DWAtt",
            task_model_class=DWAttForTokenClassification,
            base_model_class=None,
            pipeline_tag="token-classification",
            default_dataset="wnut_16",
            variant_name=lambda config: f"dwatt {config.fusion}",
            card_values=_dwatt_card_values,
        ),
    )
}


def get_family(model_type: str) -> Family:
    """The registry entry of ``model_type``.

    Raises:
        ValueError: naming the registered families when ``model_type`` is not one of them.
    """
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"model_type must be one of {sorted(FAMILIES)}; got {model_type!r}")
    return family


def causal_lm_families() -> tuple[str, ...]:
    """The ``model_type`` of every decoder family, in registry order (``scripts/train_clm.py --model``)."""
    return tuple(name for name, family in FAMILIES.items() if family.is_causal_lm)


__all__ = ["AnalysisPlot", "FAMILIES", "Family", "causal_lm_families", "get_family"]
