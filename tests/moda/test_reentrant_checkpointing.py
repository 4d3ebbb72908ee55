"""Reentrant gradient checkpointing (``use_reentrant=True``) computes MoDA's gradients exactly.

Reentrant checkpointing runs a layer without autograd and connects only its top-level positional tensors to the
graph. The depth entries (the K/V every earlier layer wrote for the token) therefore travel into and out of each
layer as flat positional tensors; before, they came back inside nested tuples, cut off from the graph, and every
gradient through them (all of layer 0's ``ffn_kv_proj``, for one) was silently missing.

Both runs compute the same float64 arithmetic (the recomputation repeats it), so the results differ at most by
summation order: one ``eps`` per term of the longest reduction (the intermediate size), relative to the tensor's
largest magnitude. (Against the reference backend, and from outside the model: test_model_vs_reference.py.)
"""

from __future__ import annotations

import pytest
import torch

from .helpers import TINY, tiny_model

F64 = torch.float64
FACTOR = TINY["intermediate_size"]  # one eps per term of the longest reduction


def close(got: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """Equal up to summation order: ``FACTOR`` eps of the larger of the two magnitudes."""
    scale = max(got.abs().max().item(), ref.abs().max().item())
    torch.testing.assert_close(got, ref, rtol=0, atol=FACTOR * torch.finfo(F64).eps * scale, msg=name)


def loss_and_grads(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The LM loss and every parameter's gradient (None when a parameter got none)."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("every_n_layers", [1, 2])  # 2: checkpointed and plain layers alternate
@pytest.mark.parametrize(
    "overrides",
    [{}, {"moda_depth_window": 2, "moda_ffn_kv": False}, {"norm_position": "post", "num_key_value_heads": 1}],
)
def test_reentrant_checkpointing_equals_no_checkpointing(monkeypatch, overrides, every_n_layers):
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "torch")
    model = tiny_model(seed=21, **overrides).to(F64).train()
    ids = torch.randint(3, 97, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: a real mask in the sequence pool
    ref_loss, ref_grads = loss_and_grads(model, ids, mask)

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True},
                                        every_n_layers=every_n_layers)
    checkpointed = [layer.gradient_checkpointing for layer in model.model.layers]
    assert checkpointed == [i % every_n_layers == 0 for i in range(len(checkpointed))]
    layer_calls = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *args: layer_calls.append(torch.is_grad_enabled()))
    loss, grads = loss_and_grads(model, ids, mask)
    # the reentrant route ran: layer 0 without autograd, then recomputed with it in the backward
    assert layer_calls == [False, True]

    close(loss, ref_loss, "loss")
    for name, ref in ref_grads.items():
        assert ref is not None and grads[name] is not None, name
        close(grads[name], ref, name)
    # the gradients that only flow through depth entries are there (and not trivially zero)
    if model.config.moda_ffn_kv:
        assert ref_grads["model.layers.0.ffn_kv_proj.weight"].abs().max() > 0
    assert ref_grads["model.layers.0.self_attn.k_proj.weight"].abs().max() > 0


def test_reentrant_checkpointing_frozen_base_with_input_grads(monkeypatch):
    """Only one layer's ``ffn_kv_proj`` trains (the rest frozen, as under PEFT): its gradient flows only through
    the depth entries it writes; ``enable_input_require_grads`` (which transformers turns on for reentrant
    checkpointing) makes the layer inputs require grad."""
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "torch")
    model = tiny_model(seed=22).to(F64).train().requires_grad_(False)
    target = model.model.layers[1].ffn_kv_proj.weight
    target.requires_grad_(True)
    ids = torch.randint(3, 97, (2, 6))
    mask = torch.ones_like(ids)
    _, ref_grads = loss_and_grads(model, ids, mask)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    _, grads = loss_and_grads(model, ids, mask)
    name = "model.layers.1.ffn_kv_proj.weight"
    assert ref_grads[name].abs().max() > 0
    close(grads[name], ref_grads[name], name)


def test_reentrant_checkpointing_without_gradients_changes_nothing(monkeypatch):
    """No backward to replay: nothing is checkpointed, same logits."""
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "torch")
    model = tiny_model(seed=23).to(F64).train()
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        ref = model(ids).logits
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        got = model(ids).logits
    assert torch.equal(got, ref)
