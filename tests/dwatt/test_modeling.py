"""DWAttForTokenClassification on tiny random encoders: shapes, loss, fusion maths, budgets, init, save/load."""

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModel, AutoModelForTokenClassification

from depthfusion_hf import DWAttForTokenClassification
from depthfusion_hf.models.configuration_dwatt import FUSION_METHODS
from depthfusion_hf.models.modeling_dwatt import DWAttTokenClassifierOutput
from depthfusion_hf.models.sizes_dwatt import concat_params_per_unit, deeper_params_per_unit

from .helpers import ID2LABEL, tiny_backbone_config, tiny_config, tiny_model

KINDS = ["bert", "roberta", "deberta-v2"]


def batch(batch_size: int = 2, length: int = 7, vocab: int = 20, pad_last: int = 2) -> dict[str, torch.Tensor]:
    """Random ids [B, T] (from 3 up, clear of special ids) with the last ``pad_last`` positions of row 1 padded."""
    input_ids = torch.randint(3, vocab, (batch_size, length))
    attention_mask = torch.ones(batch_size, length, dtype=torch.long)
    if pad_last:
        attention_mask[1, -pad_last:] = 0
        input_ids[1, -pad_last:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fusion", FUSION_METHODS)
def test_shapes_loss_and_gradients_for_every_fusion_and_encoder(fusion, kind):
    model = tiny_model(fusion, kind).train()
    inputs = batch()
    labels = torch.randint(0, 5, (2, 7))
    out = model(**inputs, labels=labels, output_depth_attentions=True, output_hidden_states=True)
    assert isinstance(out, DWAttTokenClassifierOutput)
    assert out.logits.shape == (2, 7, 5)
    assert len(out.hidden_states) == 3 and out.hidden_states[0].shape == (2, 7, 32)
    assert torch.isfinite(out.loss)
    if fusion == "dwatt":
        assert out.depth_attentions.shape == (2, 7, 3)
    else:
        assert out.depth_attentions is None
    out.loss.backward()
    assert model.classifier.weight.grad.abs().sum() > 0
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0  # the encoder is fine-tuned too
    if model.fusion is not None:
        assert all(p.grad is not None for p in model.fusion.parameters())


def test_loss_ignores_minus_100_positions():
    model = tiny_model("dwatt")
    inputs = batch()
    labels = torch.randint(0, 5, (2, 7))
    labels[0, :3] = -100
    labels[1, -2:] = -100
    out = model(**inputs, labels=labels)
    keep = labels != -100
    expected = F.cross_entropy(out.logits[keep], labels[keep])
    torch.testing.assert_close(out.loss, expected)
    other = labels.clone()
    other[0, :3] = torch.tensor([1, 2, 3])  # the labels under -100 must not matter
    masked = other.masked_fill(~keep, -100)
    assert not torch.equal(model(**inputs, labels=masked).loss, model(**inputs, labels=other).loss)
    torch.testing.assert_close(model(**inputs, labels=other.masked_fill(~keep, -100)).loss, out.loss)


def test_depth_attention_rows_sum_to_one_and_are_not_uniform_after_perturbing():
    model = tiny_model("dwatt", layers=3)
    with torch.no_grad():
        model.fusion.depth_embeddings.normal_(0, 1.0)
    weights = model(**batch(), output_depth_attentions=True).depth_attentions
    assert weights.shape == (2, 7, 4)
    assert (weights >= 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 7))
    assert weights.std(-1).min() > 1e-3  # it does weigh the layers differently


def test_dwatt_head_matches_a_naive_transcription_of_the_equations():
    model = tiny_model("dwatt", layers=3)
    head = model.fusion
    with torch.no_grad():
        head.depth_embeddings.normal_(0, 1.0)
    states = [torch.randn(2, 5, 32) for _ in range(4)]
    fused, weights = head(states)

    def f(mlp, x):  # f(x) = W LN(GELU(U x))
        return mlp.down(mlp.norm(F.gelu(mlp.up(x))))

    for b in range(2):
        for t in range(5):
            z = [s[b, t] for s in states]
            q = 1 + F.elu(z[-1] + f(head.query_mlp, z[-1]))
            k = [head.key_proj(head.depth_embeddings[n]) for n in range(4)]
            v = [head.value_norms[n](f(head.value_mlps[n], z[n])) for n in range(4)]
            a = torch.softmax(torch.stack([q @ k_n for k_n in k]), dim=0)
            h = z[-1] + sum(a[n] * v[n] for n in range(4))
            torch.testing.assert_close(weights[b, t], a)
            torch.testing.assert_close(fused[b, t], h)


def test_last_is_the_plain_token_classification_baseline():
    model = tiny_model("last")
    inputs = batch()
    hidden = model.backbone(**inputs).last_hidden_state
    torch.testing.assert_close(model(**inputs).logits, model.classifier(hidden))
    assert model.fusion_num_parameters() == 0


def test_concat_reads_every_layer():
    model = tiny_model("concat")
    states = [torch.randn(1, 4, 32) for _ in range(3)]
    base, weights = model.fusion(states, None)
    assert weights is None
    for n in range(3):
        changed = list(states)
        changed[n] = states[n] + 1.0
        assert not torch.allclose(model.fusion(changed, None)[0], base), f"z_{n} ignored"


def test_deeper_baseline_ignores_padded_positions():
    model = tiny_model("deeper")
    inputs = batch()
    out = model(**inputs).logits
    altered = {k: v.clone() for k, v in inputs.items()}
    altered["input_ids"][1, -2:] = 7  # different content under the padding mask
    torch.testing.assert_close(model(**altered).logits[1, :-2], out[1, :-2])


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("fusion", FUSION_METHODS)
def test_module_parameter_counts_match_the_config_and_the_budget(fusion, kind):
    model = tiny_model(fusion, kind, layers=4)
    config = model.config
    assert model.fusion_num_parameters() == config.fusion_num_params()
    budget = config.fusion_num_params("dwatt")
    unit = {"concat": concat_params_per_unit(32, 5), "deeper": deeper_params_per_unit(32)}
    if fusion in unit:  # rounding the solved width leaves at most half a width unit of difference
        assert abs(model.fusion_num_parameters() - budget) <= unit[fusion] / 2
    assert getattr(model.backbone, "pooler", None) is None


def test_return_dict_false_gives_a_tuple():
    model = tiny_model("dwatt")
    inputs = batch()
    logits = model(**inputs, return_dict=False)[0]
    assert isinstance(model(**inputs, return_dict=False), tuple)
    torch.testing.assert_close(logits, model(**inputs, return_dict=True).logits)


def test_from_pretrained_backbone_keeps_encoder_weights_and_initialises_only_the_head(tmp_path):
    encoder = AutoModel.from_config(tiny_backbone_config("bert"))
    encoder.save_pretrained(tmp_path / "encoder")
    reference = encoder.state_dict()
    torch.manual_seed(1)
    model = DWAttForTokenClassification.from_pretrained_backbone(tmp_path / "encoder", fusion="dwatt",
                                                                 id2label=ID2LABEL)
    for name, tensor in model.backbone.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    assert model.config.id2label == ID2LABEL and model.config.label2id["B-LOC"] == 3
    assert model.config.backbone_config._attn_implementation == encoder.config._attn_implementation
    std = encoder.config.initializer_range
    assert abs(model.classifier.weight.std().item() - std) < 0.5 * std
    assert torch.all(model.classifier.bias == 0)
    assert torch.all(model.fusion.value_norms[0].weight == 1)
    torch.manual_seed(1)
    again = DWAttForTokenClassification.from_pretrained_backbone(tmp_path / "encoder", fusion="dwatt",
                                                                 id2label=ID2LABEL)
    assert torch.equal(again.fusion.depth_embeddings, model.fusion.depth_embeddings)  # seeded head init


@pytest.mark.parametrize("fusion", FUSION_METHODS)
def test_save_and_load_give_the_same_weights_and_logits(fusion, tmp_path):
    model = tiny_model(fusion)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # nothing left at its init value
    model.save_pretrained(tmp_path)
    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
    assert type(loaded) is DWAttForTokenClassification
    assert loaded.config.fusion == fusion
    state = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    inputs = batch()
    # Identical weights; the loaded ones are memory-mapped (not 64-byte aligned), which can change
    # SIMD summation order by an ulp, hence the float32-epsilon tolerance rather than torch.equal.
    torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-6)


def test_auto_class_builds_from_config():
    model = AutoModelForTokenClassification.from_config(tiny_config("concat"))
    assert type(model) is DWAttForTokenClassification and model.config.fusion == "concat"


def test_wrong_number_of_hidden_states_is_reported():
    model = tiny_model("dwatt")
    model.config.backbone_config.num_hidden_layers = 5  # config out of sync with the built encoder
    with pytest.raises(ValueError, match="hidden states"):
        model(**batch())
