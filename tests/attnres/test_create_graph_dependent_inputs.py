"""The AttnRes op under ``create_graph=True`` with sources that depend on one another and on the call's parameters
(found by review in an earlier version; see ``test_create_graph_model.py`` for the model): the gradients taken
with ``create_graph=True`` and a second-order gradient through them equal the reference backend's in float64."""

from __future__ import annotations

import pytest
import torch

from depthfusion_hf.models.attnres import attention_residual

from .helpers import set_small_numel

EPS64 = torch.finfo(torch.float64).eps


def dependent_inputs():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64).requires_grad_()
    query = (0.5 * torch.randn(6, generator=gen, dtype=torch.float64)).requires_grad_()
    weight = (1 + 0.3 * torch.randn(6, generator=gen, dtype=torch.float64)).requires_grad_()
    v0 = x.sin()
    v1 = (v0 * 2).tanh() + query  # a later source computed from an earlier one and from the query
    return x, query, weight, [v0, v1, v0 * v1]


@pytest.mark.parametrize("forward", ["list", "stacked"])
def test_op_create_graph_with_dependent_sources(monkeypatch, forward):
    if forward == "list":
        set_small_numel(monkeypatch, -1)
    results = []
    for backend in ("torch", "reference"):
        x, query, weight, sources = dependent_inputs()
        h = attention_residual(query, sources, weight, backend=backend)
        grads = torch.autograd.grad(h.pow(2).sum(), [x, query, weight], create_graph=True)
        second = torch.autograd.grad(sum(g.pow(2).sum() for g in grads), [x, query, weight])
        results.append([g.detach() for g in grads] + list(second))
    for g, w in zip(*results):
        torch.testing.assert_close(g, w, rtol=0, atol=256 * EPS64 * max(1.0, w.abs().max().item()))
