"""DWAttConfig: defaults, validation errors naming the field, sub-config round trip, parameter budgets."""

import pytest
from transformers import BertConfig, RobertaConfig

from depthfusion_hf import DWAttConfig
from depthfusion_hf.models.configuration_dwatt import (
    concat_head_num_params,
    deeper_head_num_params,
    dwatt_head_num_params,
)
from depthfusion_hf.models.sizes_dwatt import concat_params_per_unit, deeper_params_per_unit

from .helpers import tiny_backbone_config, tiny_config


def test_defaults_follow_the_paper_and_default_backbone_is_bert():
    config = DWAttConfig()
    assert config.fusion == "dwatt"
    assert config.depth_embedding_size == 24
    assert config.bottleneck_ratio == 0.5
    assert isinstance(config.backbone_config, BertConfig)
    assert config.num_states == config.backbone_config.num_hidden_layers + 1
    assert config.bottleneck_size == config.backbone_config.hidden_size // 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"fusion": "mean"}, "fusion"),
        ({"fusion": None}, "fusion"),
        ({"depth_embedding_size": 0}, "depth_embedding_size"),
        ({"depth_embedding_size": 2.5}, "depth_embedding_size"),
        ({"bottleneck_ratio": 0.0}, "bottleneck_ratio"),
        ({"bottleneck_ratio": 1.5}, "bottleneck_ratio"),
        ({"deeper_num_layers": 0}, "deeper_num_layers"),
        ({"concat_hidden_size": -3}, "concat_hidden_size"),
        ({"deeper_intermediate_size": 0}, "deeper_intermediate_size"),
        ({"deeper_num_attention_heads": 5}, "deeper_num_attention_heads"),
        ({"classifier_dropout": 1.0}, "classifier_dropout"),
        ({"initializer_range": -0.1}, "initializer_range"),
        ({"backbone_config": {"hidden_size": 32}}, "backbone_config"),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(kwargs, field):
    kwargs.setdefault("backbone_config", tiny_backbone_config())
    with pytest.raises(ValueError, match=field):
        DWAttConfig(**kwargs)


def test_bad_fusion_lists_the_allowed_values():
    with pytest.raises(ValueError) as info:
        DWAttConfig(backbone_config=tiny_backbone_config(), fusion="sum")
    for allowed in ("dwatt", "concat", "last", "deeper"):
        assert allowed in str(info.value)


def test_round_trip_through_dict_keeps_backbone_type_and_sizes():
    config = tiny_config("concat", kind="roberta", depth_embedding_size=8)
    again = DWAttConfig.from_dict(config.to_dict())
    assert isinstance(again.backbone_config, RobertaConfig)
    assert again.backbone_config.hidden_size == 32
    assert (again.fusion, again.depth_embedding_size) == ("concat", 8)
    assert again.concat_hidden_size == config.concat_hidden_size
    assert again.id2label == config.id2label and again.num_labels == 5


def test_dict_backbone_is_resolved_by_model_type():
    config = DWAttConfig(backbone_config={"model_type": "roberta", "hidden_size": 48, "num_attention_heads": 4,
                                          "num_hidden_layers": 3})
    assert isinstance(config.backbone_config, RobertaConfig)
    assert config.num_states == 4


@pytest.mark.parametrize(("hidden", "layers", "heads"), [(32, 2, 4), (64, 4, 4), (384, 6, 12), (768, 12, 12),
                                                        (1024, 24, 16)])
def test_baselines_are_sized_to_the_dwatt_head_within_half_a_width_unit(hidden, layers, heads):
    # The solved widths are rounded to the nearest integer, so each baseline misses the budget by at most half
    # the parameters one unit of its width costs: the bound the arithmetic gives, and no looser.
    backbone = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads)
    config = DWAttConfig(backbone_config=backbone)
    budget = config.fusion_num_params("dwatt")
    assert budget == dwatt_head_num_params(hidden, layers + 1, hidden // 2, 24)
    unit = {"concat": concat_params_per_unit(hidden, layers + 1), "deeper": deeper_params_per_unit(hidden)}
    for fusion in ("concat", "deeper"):
        assert abs(config.fusion_num_params(fusion) - budget) <= unit[fusion] / 2, fusion
    assert config.fusion_num_params("last") == 0


def test_documented_head_sizes_of_the_minilm_run():
    # docs/RESULTS.md: dwatt 1,202,472 · concat 1,202,709 (+0.02 %) · deeper 1,202,328 (-0.01 %), widths 391 / 792.
    config = DWAttConfig(backbone_config=BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12))
    assert (config.concat_hidden_size, config.deeper_intermediate_size) == (391, 792)
    sizes = {fusion: config.fusion_num_params(fusion) for fusion in ("dwatt", "concat", "deeper")}
    assert sizes == {"dwatt": 1_202_472, "concat": 1_202_709, "deeper": 1_202_328}
    assert round(100 * (sizes["concat"] / sizes["dwatt"] - 1), 2) == 0.02
    assert round(100 * (sizes["deeper"] / sizes["dwatt"] - 1), 2) == -0.01


def test_explicit_sizes_are_kept():
    config = tiny_config(concat_hidden_size=7, deeper_intermediate_size=9)
    assert config.fusion_num_params("concat") == concat_head_num_params(32, 3, 7)
    assert config.fusion_num_params("deeper") == deeper_head_num_params(32, 9)
