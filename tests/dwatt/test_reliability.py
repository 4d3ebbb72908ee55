"""DWAtt bad inputs: malformed backbone configs, configs changed after construction, empty or out-of-vocabulary
token inputs. Each is a ValueError that names the problem, never an internal IndexError / reshape error /
KeyError. Also the fusion-head table every head is read through."""

import pytest
import torch
from transformers import BertConfig, PreTrainedConfig

from depthfusion_hf import DWAttConfig, DWAttForTokenClassification
from depthfusion_hf.models.configuration_dwatt import FUSION_METHODS
from depthfusion_hf.models.fusion_dwatt import FUSION_HEADS, DWAttFusionHead

from .helpers import VOCAB, tiny_backbone_config, tiny_config, tiny_model

BAD_BACKBONES = [
    pytest.param({"model_type": "no-such-encoder", "hidden_size": 32}, "unknown model_type 'no-such-encoder'",
                 id="unknown-model-type"),
    pytest.param({"model_type": "dwatt"}, "cannot be a DWAtt config", id="dwatt-dict"),
    pytest.param("dwatt-self", "cannot be a DWAttConfig", id="dwatt-config-object"),
    pytest.param(PreTrainedConfig(), "has no `hidden_size`", id="missing-hidden-size"),
    pytest.param(BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=0),
                 r"invalid \(0\) `num_hidden_layers`", id="zero-layers"),
    pytest.param("bert", "must be None, a dict with `model_type` or a PreTrainedConfig; got str", id="a-string"),
    pytest.param({"hidden_size": 32}, "must contain `model_type`", id="dict-without-model-type"),
]


@pytest.mark.parametrize(("backbone", "message"), BAD_BACKBONES)
def test_malformed_backbone_configs_raise_value_errors_naming_the_problem(backbone, message):
    if backbone == "dwatt-self":
        backbone = tiny_config()
    with pytest.raises(ValueError, match=message) as info:
        DWAttConfig(backbone_config=backbone)
    assert "backbone_config" in str(info.value)


MUTATIONS = [
    ("fusion", "mean"),
    ("depth_embedding_size", 0),
    ("bottleneck_ratio", 0.0),
    ("concat_hidden_size", 0),
    ("deeper_num_layers", 0),
    ("deeper_intermediate_size", -1),
    ("deeper_num_attention_heads", 5),
    ("classifier_dropout", 1.0),
    ("initializer_range", 0.0),
]


@pytest.mark.parametrize(("field", "value"), MUTATIONS, ids=[field for field, _ in MUTATIONS])
def test_config_changed_after_construction_gives_the_construction_error(field, value):
    with pytest.raises(ValueError) as at_construction:
        tiny_config(**{field: value})
    config = tiny_config()
    setattr(config, field, value)
    with pytest.raises(ValueError) as at_build:
        DWAttForTokenClassification(config)
    assert str(at_build.value) == str(at_construction.value)
    assert field in str(at_build.value)


def test_backbone_replaced_after_construction_is_rejected_when_the_model_is_built():
    config = tiny_config()
    config.backbone_config = tiny_config()
    with pytest.raises(ValueError, match="cannot be a DWAttConfig"):
        DWAttForTokenClassification(config)


VOCAB_SIZE = len(VOCAB) + 10  # tiny_backbone_config's vocabulary
BAD_TOKENS = [
    pytest.param({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, r"input_ids must have at least one token; "
                 r"got shape \(1, 0\)", id="no-tokens"),
    pytest.param({"input_ids": torch.zeros(0, 4, dtype=torch.long)}, "at least one token", id="empty-batch"),
    pytest.param({"inputs_embeds": torch.zeros(1, 0, 32)}, "inputs_embeds must have at least one token",
                 id="no-embedded-tokens"),
    pytest.param({"input_ids": torch.tensor([[5, VOCAB_SIZE]])},
                 rf"input_ids must lie in \[0, vocab_size={VOCAB_SIZE}\); got min 5, max {VOCAB_SIZE}",
                 id="id-too-big"),
    pytest.param({"input_ids": torch.tensor([[-1, 5]])}, r"got min -1, max 5", id="negative-id"),
    pytest.param({"input_ids": torch.tensor([[1.0, 5.0]])}, "integer tensor", id="float-ids"),
    pytest.param({"input_ids": torch.tensor([1, 5])}, r"shape \[batch, tokens\]", id="one-dim-ids"),
]


@pytest.mark.parametrize(("inputs", "message"), BAD_TOKENS)
@pytest.mark.parametrize("fusion", ["dwatt", "last"])
def test_bad_token_inputs_raise_value_errors_naming_the_problem(inputs, message, fusion):
    model = tiny_model(fusion)
    with pytest.raises(ValueError, match=message):
        model(**inputs)


def test_the_vocabulary_bound_follows_resized_embeddings():
    model = tiny_model("dwatt")
    model.resize_token_embeddings(VOCAB_SIZE + 3)
    assert model(input_ids=torch.tensor([[3, VOCAB_SIZE + 2]])).logits.shape == (1, 2, 5)
    with pytest.raises(ValueError, match=f"vocab_size={VOCAB_SIZE + 3}"):
        model(input_ids=torch.tensor([[VOCAB_SIZE + 3]]))


@pytest.mark.parametrize("fusion", FUSION_METHODS)
def test_every_head_is_read_through_the_one_table(fusion):
    assert tuple(FUSION_HEADS) == FUSION_METHODS == ("dwatt", "concat", "last", "deeper", "last_ln")
    head_class = FUSION_HEADS[fusion]
    assert issubclass(head_class, DWAttFusionHead) and head_class.name == fusion
    model = tiny_model(fusion, layers=3)
    assert type(model.fusion) is head_class
    assert model.fusion_num_parameters() == head_class.num_params(model.config) == model.config.fusion_num_params()
    states = [torch.randn(2, 4, 32) for _ in range(4)]
    mask = torch.ones(2, 4, dtype=torch.long)
    fused, weights = model.fusion(states, mask)
    assert fused.shape == (2, 4, 32)
    if fusion == "dwatt":
        assert weights.shape == (2, 4, 4)
    else:
        assert weights is None
    if fusion == "last":
        assert fused is states[-1]


def test_fusion_num_params_rejects_an_unknown_head():
    with pytest.raises(ValueError, match="`fusion` must be one of"):
        tiny_config().fusion_num_params("mean")


def test_backbone_config_from_a_dict_still_builds():
    config = DWAttConfig(backbone_config=tiny_backbone_config().to_dict())
    assert config.hidden_size == 32 and config.num_states == 3


BAD_ENCODER_INPUTS = [
    pytest.param("bert", {"input_ids": torch.randint(5, 20, (1, 65))},
                 r"65 tokens, more than the encoder takes: at most 64 \(max_position_embeddings = 64\)",
                 id="bert-too-long"),
    pytest.param("roberta", {"input_ids": torch.randint(5, 20, (1, 63))},
                 r"63 tokens, more than the encoder takes: at most 62 \(max_position_embeddings = 64, positions "
                 r"starting at padding_idx \+ 1 = 2\)", id="roberta-too-long"),
    pytest.param("bert", {"inputs_embeds": torch.zeros(1, 65, 32)}, "at most 64", id="bert-embeds-too-long"),
    # Before: a bare IndexError (a device-side assert on CUDA): the check knew only `embeddings.position_embeddings`.
    pytest.param("gpt2", {"input_ids": torch.randint(5, 20, (1, 65))},
                 r"65 tokens, more than the encoder takes: at most 64 \(max_position_embeddings = 64\)",
                 id="gpt2-too-long"),
    pytest.param("gpt2", {"input_ids": torch.tensor([[5, 6]]), "position_ids": torch.tensor([[0, 64]])},
                 r"position_ids must lie in \[0, 64\)", id="gpt2-position-out-of-range"),
    pytest.param("bert", {"input_ids": torch.tensor([[5, 6]]), "token_type_ids": torch.tensor([[0, 2]])},
                 r"token_type_ids must lie in \[0, 2\) \(the encoder's type_vocab_size\); got min 0, max 2",
                 id="token-type-out-of-range"),
    pytest.param("bert", {"input_ids": torch.tensor([[5, 6]]), "token_type_ids": torch.tensor([[0, 1, 0]])},
                 r"token_type_ids must have the inputs' shape \(1, 2\); got \(1, 3\)", id="token-type-shape"),
    pytest.param("bert", {"input_ids": torch.tensor([[5, 6]]), "position_ids": torch.tensor([[0, 64]])},
                 r"position_ids must lie in \[0, 64\)", id="position-out-of-range"),
    pytest.param("bert", {"input_ids": torch.tensor([[5, 6]]), "labels": torch.tensor([[0, 1, 2]])},
                 r"labels must have the inputs' shape \(1, 2\) .*got \(1, 3\)", id="labels-shape"),
    pytest.param("bert", {"input_ids": torch.tensor([[5, 6]]), "labels": torch.tensor([0, 1])},
                 r"labels must have the inputs' shape \(1, 2\)", id="labels-flat"),
    pytest.param("bert", {"input_ids": torch.tensor([[5, 6]]), "labels": torch.tensor([[0, 5]])},
                 r"labels must lie in \[0, 5\) \(num_labels = 5, or -100 to ignore a token\); got min 0, max 5",
                 id="label-out-of-range"),
    pytest.param("bert", {"input_ids": torch.tensor([[5, 6]]), "labels": torch.tensor([[-100, -3]])},
                 r"labels must lie in \[0, 5\).*got min -3", id="negative-label"),
    pytest.param("bert", {"input_ids": torch.tensor([[5, 6]]), "labels": torch.tensor([[0.0, 1.0]])},
                 r"labels must be an integer tensor; got torch.float32", id="float-labels"),
]


@pytest.mark.parametrize(("kind", "inputs", "message"), BAD_ENCODER_INPUTS)
def test_inputs_the_encoder_cannot_take_raise_value_errors_naming_the_limit(kind, inputs, message):
    """Before: an IndexError or a shape error deep inside the backbone or the loss."""
    model = tiny_model("dwatt", kind=kind)
    with pytest.raises(ValueError, match=message):
        model(**inputs)


@pytest.mark.parametrize(("kind", "length"), [("bert", 64), ("roberta", 62), ("deberta-v2", 64), ("gpt2", 64)])
def test_inputs_at_the_position_limit_run(kind, length):
    model = tiny_model("dwatt", kind=kind)
    labels = torch.full((1, length), -100)
    labels[0, 3] = 4
    out = model(input_ids=torch.randint(5, 20, (1, length)), labels=labels)
    assert out.logits.shape == (1, length, 5) and torch.isfinite(out.loss)


def test_a_training_step_with_labels_and_token_types_compiles_whole():
    """The label and token-type checks run as ops under ``torch.compile``, as the token-id check does (a host read
    of a tensor is a data-dependent guard: ``fullgraph=True`` failed on 'Eq(u0, 1)' as soon as labels were given)."""
    model = tiny_model("dwatt")
    inputs = {"input_ids": torch.tensor([[2, 5, 6, 3]]), "token_type_ids": torch.tensor([[0, 0, 1, 1]]),
              "position_ids": torch.tensor([[0, 1, 2, 3]]), "labels": torch.tensor([[0, 1, 2, -100]])}
    eager = model(**inputs).loss
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(**inputs).loss, eager, rtol=0, atol=0)
