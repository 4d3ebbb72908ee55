"""DenseFormer rejects configs changed after construction and token inputs it cannot compute."""

import pytest
import torch

from depthfusion_hf import DenseFormerForCausalLM, DenseFormerModel
from depthfusion_hf.models.depthfusion_common import check_token_inputs

from .helpers import tiny_config

VOCAB = tiny_config().vocab_size
HIDDEN = tiny_config().hidden_size


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("dwa_dilation", 0, r"`dwa_dilation` must be an integer in \[1, 6\]"),
        ("dwa_period", 7, r"`dwa_period` must be an integer in \[1, 6\]"),
        ("num_hidden_layers", 0, r"`num_hidden_layers` must be an integer >= 1"),
        ("num_key_value_heads", 3, r"multiple of `num_key_value_heads` \(3\)"),
    ],
)
@pytest.mark.parametrize("model_class", [DenseFormerModel, DenseFormerForCausalLM])
def test_config_changed_after_construction_is_rejected_by_the_model(model_class, field, value, match):
    config = tiny_config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        config.check_fields()
    with pytest.raises(ValueError, match=match):
        model_class(config)


@pytest.fixture(scope="module")
def model():
    return DenseFormerForCausalLM(tiny_config()).eval()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"input_ids": torch.zeros(1, 0, dtype=torch.long)},
         r"input_ids must have at least one token; got shape \(1, 0\)"),
        ({"input_ids": torch.zeros(0, 4, dtype=torch.long)}, r"at least one token; got shape \(0, 4\)"),
        ({"inputs_embeds": torch.zeros(1, 0, HIDDEN)},
         rf"inputs_embeds must have at least one token; got shape \(1, 0, {HIDDEN}\)"),
        ({"input_ids": torch.tensor([[3, -1, 7]])},
         rf"input_ids must lie in \[0, vocab_size={VOCAB}\); got min -1, max 7"),
        ({"input_ids": torch.tensor([[3, VOCAB]])}, rf"\[0, vocab_size={VOCAB}\); got min 3, max {VOCAB}"),
        ({"input_ids": torch.tensor([[1.0, 2.0]])}, r"input_ids must be an integer tensor; got torch.float32"),
        ({"input_ids": torch.tensor([True, False])[None]}, r"integer tensor; got torch.bool"),
        ({"input_ids": torch.tensor([3, 4])}, r"input_ids must have shape \[batch, tokens\]; got shape \(2,\)"),
        ({"inputs_embeds": torch.zeros(2, HIDDEN)}, r"inputs_embeds must have shape \[batch, tokens, hidden\]"),
        ({}, "exactly one of input_ids or inputs_embeds"),
        ({"input_ids": torch.tensor([[3]]), "inputs_embeds": torch.zeros(1, 1, HIDDEN)}, "exactly one of"),
    ],
    ids=["empty-T", "empty-B", "empty-embeds", "negative-id", "id-equals-vocab", "float-ids", "bool-ids",
         "1d-ids", "2d-embeds", "neither", "both"],
)
def test_bad_token_inputs_name_the_problem(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_token_inputs(kwargs.get("input_ids"), kwargs.get("inputs_embeds"), VOCAB)
    with pytest.raises(ValueError, match=match), torch.no_grad():
        model(**kwargs)


def test_valid_edge_ids_pass(model):
    ids = torch.tensor([[0, VOCAB - 1]])
    check_token_inputs(ids, None, VOCAB)
    check_token_inputs(ids.int(), None, VOCAB)
    with torch.no_grad():
        assert model(ids).logits.shape == (1, 2, VOCAB)
