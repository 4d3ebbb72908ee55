"""A backward with ``create_graph=True`` through the AttnRes model (found by review in an earlier version): its
custom backward answered it by differentiating the reference with ``torch.autograd.grad`` with respect to its saved
inputs, which depend on one another through the model's forward (a later source is computed from an earlier one),
so the gradient came out as the total derivative through the forward: every gradient was wrong, first order
included. The torch backend's backward is now written in differentiable operators; checked here against the
reference backend (plain autograd) in float64: the first-order gradients taken with ``create_graph=True`` and a
second-order gradient through them.

Eager attention: SDPA's fused CPU kernel has no double backward.
"""

from __future__ import annotations

import pytest
import torch

from depthfusion_hf.models.modeling_attnres import AttnResForCausalLM

from .helpers import randomise_attnres, set_small_numel, tiny_config

EPS64 = torch.finfo(torch.float64).eps


def eager_float64_model(block_size: int | None) -> AttnResForCausalLM:
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=block_size, attn_implementation="eager"))
    randomise_attnres(model)
    return model.double()


def first_and_second_order(model: AttnResForCausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every parameter's gradient of the loss (taken with ``create_graph=True``), then every parameter's gradient
    of the squared norm of those gradients."""
    params = list(model.parameters())
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    grads = torch.autograd.grad(loss, params, create_graph=True)
    second = torch.autograd.grad(sum((g * g).sum() for g in grads), params, allow_unused=True)
    return [g.detach() for g in grads] + [torch.zeros_like(p) if s is None else s for p, s in zip(params, second)]


@pytest.mark.parametrize("forward", ["list", "stacked"])
@pytest.mark.parametrize("block_size", [None, 3], ids=lambda s: f"block{s}")
def test_create_graph_gradients_equal_reference_backend(monkeypatch, forward, block_size):
    if forward == "list":
        set_small_numel(monkeypatch, -1)  # tiny shapes take the forward training sizes take
    model = eager_float64_model(block_size)
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "torch")
    got = first_and_second_order(model, ids)
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
    want = first_and_second_order(model, ids)
    names = [n for n, _ in model.named_parameters()]
    names = [f"d {n}" for n in names] + [f"d2 {n}" for n in names]
    for name, g, w in zip(names, got, want):
        err = (g - w).norm() / w.norm().clamp_min(1e-300)
        assert err <= 256 * EPS64 * w.numel() ** 0.5, f"{name}: relative error {err:.2e}"
