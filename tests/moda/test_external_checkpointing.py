"""Activation checkpointing applied to MoDA's layers from outside (``torch.utils.checkpoint`` around a layer's
forward, as FSDP's ``apply_activation_checkpointing`` or a training framework does), not through
``gradient_checkpointing_enable`` (which the model sees and answers with the tuple path).

Non-reentrant: the original graph is kept and the recomputation only refills saved tensors, so the depth stream's
gradients are exact (float64, against the reference backend's tuple path). Reentrant: the layer's forward runs
without gradients, so the entries it writes into the stream are untracked and the later layers' gradients through
them are lost; found by review to return wrong gradients silently, it now raises when the layer is recomputed.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from .helpers import tiny_model
from .test_fast_path_review import close, fast_path, reference_path


def checkpoint_layers(model, layers: list[int], reentrant: bool) -> None:
    """Wrap the forward of each of ``layers`` in ``torch.utils.checkpoint`` (the model is not told)."""
    for i in layers:
        layer = model.model.layers[i]
        forward = layer.forward

        def wrapped(*args, _forward=forward, **kwargs):
            return checkpoint(functools.partial(_forward, **kwargs), *args, use_reentrant=reentrant)

        layer.forward = wrapped


def parameter_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layers", [[1], [0, 1, 2, 3]], ids=["one-layer", "every-layer"])
def test_non_reentrant_checkpointing_from_outside_equals_the_reference(monkeypatch, layers):
    model = tiny_model(seed=1).to(torch.float64).train()
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    with reference_path(model, monkeypatch):
        want = parameter_grads(model, ids)
    checkpoint_layers(model, layers, reentrant=False)
    with fast_path(monkeypatch):
        got = parameter_grads(model, ids)
    for name, g in want.items():
        close(got[name], g, 256.0)


def test_reentrant_checkpointing_from_outside_is_rejected(monkeypatch):
    model = tiny_model(seed=1).to(torch.float64).train()
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    checkpoint_layers(model, [1], reentrant=True)
    with fast_path(monkeypatch), pytest.raises(RuntimeError, match="gradient_checkpointing_enable"):
        parameter_grads(model, ids)
