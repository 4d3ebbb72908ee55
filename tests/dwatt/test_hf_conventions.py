"""DWAtt follows transformers' model conventions (the failures of transformers' common tests, issue 21, and the
issue 19 items): resizing the vocabulary survives save -> load, ``output_hidden_states`` selects layers, the
encoder's shape fields are the backbone's, a plain encoder folder loads with a fresh head, label fields are
validated."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, BertModel, RobertaModel

from depthfusion_hf import DWAttConfig, DWAttForTokenClassification

from .helpers import VOCAB, tiny_backbone_config, tiny_config, tiny_model

VOCAB_SIZE = len(VOCAB) + 10


@pytest.mark.parametrize("fusion", ["dwatt", "last"])
def test_resized_vocabulary_survives_save_and_load(fusion, tmp_path):
    """resize_token_embeddings writes the encoder's vocab_size (before: the DWAtt config's own, so the next load
    built the old-size embedding and failed on the checkpoint's)."""
    model = tiny_model(fusion)
    model.resize_token_embeddings(VOCAB_SIZE + 7)
    assert model.config.backbone_config.vocab_size == VOCAB_SIZE + 7 == model.config.vocab_size
    model.save_pretrained(tmp_path)
    assert load_file(tmp_path / "model.safetensors")["backbone.embeddings.word_embeddings.weight"].shape[0] == \
        VOCAB_SIZE + 7
    loaded = DWAttForTokenClassification.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[3, VOCAB_SIZE + 6, 5]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_config_written_by_the_old_resize_loads_with_the_resized_vocabulary():
    """Configs written before held the resized size at the top level: it is the encoder's (the checkpoint's)."""
    fields = tiny_config().to_dict()
    fields["vocab_size"] = VOCAB_SIZE + 7
    config = DWAttConfig.from_dict(fields)
    assert config.backbone_config.vocab_size == VOCAB_SIZE + 7
    assert "vocab_size" not in config.to_dict()


@pytest.mark.parametrize(("selection", "kept"), [([0, 2], {0, 2}), ([-1], {2}), (1, {1}), ([0, 5, -4], {0}),
                                                 (True, {0, 1, 2})])
def test_output_hidden_states_selects_layers(selection, kept):
    """transformers 5: indices keep those states (negative ones from the end, out-of-range ones select nothing)
    and give None for the others; True keeps all (before: any list counted as True)."""
    model = tiny_model("dwatt")
    ids = torch.randint(5, VOCAB_SIZE, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        everything = model(input_ids=ids, output_hidden_states=True).hidden_states
        selected = model(input_ids=ids, output_hidden_states=selection).hidden_states
    assert len(everything) == len(selected) == 3
    for i, state in enumerate(selected):
        if i in kept:
            assert torch.equal(state, everything[i])
        else:
            assert state is None
    assert model(input_ids=ids, output_hidden_states=False).hidden_states is None


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers"])
def test_encoder_shape_fields_are_read_from_the_backbone_and_named_when_passed(field):
    """``DWAttConfig(hidden_size=32)`` raised "property has no setter"; now a ValueError names the field, where it
    belongs and the way to start from a pretrained encoder."""
    with pytest.raises(ValueError, match=rf"`{field}` \(7\) belongs to the encoder.*backbone_config.*"
                                         r"from_pretrained_backbone"):
        DWAttConfig(**{field: 7})
    config = tiny_config()
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 2, VOCAB_SIZE)


@pytest.mark.parametrize(("encoder_class", "kind"), [(BertModel, "bert"), (RobertaModel, "roberta")])
def test_from_pretrained_on_a_plain_encoder_folder_adds_a_fresh_head(encoder_class, kind, tmp_path):
    """As BertForTokenClassification.from_pretrained(<BertModel folder>): the encoder's weights load under
    ``backbone.``, the head and classifier are initialised and reported missing (before: "property has no
    setter" from the encoder's config fields)."""
    torch.manual_seed(0)
    encoder = encoder_class(tiny_backbone_config(kind)).eval()
    encoder.save_pretrained(tmp_path)
    model, info = DWAttForTokenClassification.from_pretrained(tmp_path, num_labels=3, output_loading_info=True)
    assert model.config.num_labels == 3 and model.config.backbone_config.model_type == kind
    assert any(key.startswith("classifier.") for key in info["missing_keys"])
    assert any(key.startswith("fusion.") for key in info["missing_keys"])
    assert not any(key.startswith("backbone.") for key in info["missing_keys"])
    ours = dict(model.backbone.named_parameters())
    for name, p in encoder.named_parameters():
        if not name.startswith("pooler."):
            assert torch.equal(ours[name], p), name
    ids = torch.randint(5, VOCAB_SIZE, (1, 5))
    assert model(input_ids=ids).logits.shape == (1, 5, 3)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), type(encoder.config))  # the folder is untouched


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_labels": -1}, r"`num_labels` must be an integer >= 1; got -1"),
        ({"num_labels": 0}, r"`num_labels` must be an integer >= 1; got 0"),
        ({"id2label": {0: "O", 2: "B-PER"}},
         r"`id2label` must map each class index 0\.\.1 .* got the indices \[0, 2\]"),
        ({"id2label": {}}, r"`num_labels` must be an integer >= 1; `id2label` has no entries"),
    ],
    ids=["num-labels-negative", "num-labels-zero", "gapped-id2label", "empty-id2label"],
)
def test_label_fields_are_validated(kwargs, message):
    """num_labels=-1 built a 0-class head; a gapped id2label failed deep in the loss."""
    with pytest.raises(ValueError, match=message):
        DWAttConfig(backbone_config=tiny_backbone_config(), **kwargs)


def test_a_gapped_id2label_set_after_construction_is_rejected_when_the_model_is_built():
    config = tiny_config()
    config.id2label = {0: "O", 1: "B-PER", 3: "I-PER"}
    with pytest.raises(ValueError, match="`id2label` must map each class index"):
        DWAttForTokenClassification(config)
