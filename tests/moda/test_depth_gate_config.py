"""The learned depth gate as a model option: off by default (the paper's MoDA, unchanged), bit-identical logits and
gradients when on at its initial 1, per (layer, query head) on the layers that read depth entries, the straight-
through clamp, and the config's validation."""

import pytest
import torch

from depthfusion_hf import MoDAConfig, MoDAForCausalLM
from depthfusion_hf.models.modeling_moda import straight_through_clamp

from .helpers import tiny_config, tiny_model


def test_default_has_no_gate():
    config = MoDAConfig()
    assert config.moda_depth_gate is False and config.moda_depth_gate_init == 1.0
    model = tiny_model()
    assert not any("depth_gate" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("ffn_kv", [True, False])
def test_gates_at_one_give_the_ungated_model_bit_for_bit(attn_implementation, ffn_kv):
    """From-scratch MoDA is unchanged by the option at its initial value: logits and every shared parameter's
    gradient are identical (torch.equal) to the model without gates, with padding too."""
    plain = tiny_model(attn_implementation=attn_implementation, moda_ffn_kv=ffn_kv).train()
    gated = MoDAForCausalLM(tiny_config(attn_implementation=attn_implementation, moda_ffn_kv=ffn_kv,
                                        moda_depth_gate=True)).train()
    result = gated.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(result.missing_keys) == [f"model.layers.{i}.self_attn.{name}" for i in (1, 2, 3)
                                           for name in ("depth_gate", "depth_gate_log_scale")]
    assert not result.unexpected_keys
    assert all(torch.equal(layer.self_attn.depth_gate, torch.ones(4)) for layer in gated.model.layers[1:])
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0
    outputs = [model(ids, attention_mask=attention_mask, labels=ids) for model in (plain, gated)]
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    for output in outputs:
        output.loss.backward()
    gated_params = dict(gated.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(param.grad, gated_params[name].grad), name
    assert all(layer.self_attn.depth_gate.grad.abs().min() > 0 for layer in gated.model.layers[1:])


def test_the_gate_is_per_query_head_and_clamped_straight_through():
    model = tiny_model(moda_depth_gate=True, moda_depth_gate_init=0.5)
    gates = [layer.self_attn.depth_gate for layer in model.model.layers]
    assert gates[0] is None and all(g.shape == (4,) and torch.equal(g, torch.full((4,), 0.5)) for g in gates[1:])
    raw = torch.tensor([-0.3, 0.0, 0.7], requires_grad=True)
    clamped = straight_through_clamp(raw)
    assert torch.equal(clamped, torch.tensor([0.0, 0.0, 0.7]))
    (grad,) = torch.autograd.grad((clamped * torch.tensor([1.0, 2.0, 3.0])).sum(), raw)
    assert torch.equal(grad, torch.tensor([1.0, 2.0, 3.0]))  # a gate below 0 still learns (it can reopen)
    with torch.no_grad():
        model.model.layers[1].self_attn.depth_gate.fill_(-1.0)  # below 0: closed, as at 0
        below = model(torch.arange(3, 11)[None]).logits
        model.model.layers[1].self_attn.depth_gate.fill_(0.0)
        assert torch.equal(below, model(torch.arange(3, 11)[None]).logits)


@pytest.mark.parametrize("field, value, message", [
    ("moda_depth_gate", "learned", "`moda_depth_gate` must be a bool"),
    ("moda_depth_gate", 1, "`moda_depth_gate` must be a bool"),
    ("moda_depth_gate_init", -0.5, "`moda_depth_gate_init` must be a finite number >= 0.0"),
    ("moda_depth_gate_init", float("inf"), "`moda_depth_gate_init` must be a finite number >= 0.0"),
    ("moda_depth_gates", True, "nearest valid name is `moda_depth_gate`"),
])
def test_bad_gate_options_are_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{field: value})
