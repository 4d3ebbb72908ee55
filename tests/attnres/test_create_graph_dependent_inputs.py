"""The AttnRes op and the logit-rows path under ``create_graph=True`` with sources that depend on one another and
on the call's parameters (found by review; see ``test_create_graph_model.py`` for the model): the gradients taken
with ``create_graph=True`` and a second-order gradient through them equal the reference backend's in float64."""

from __future__ import annotations

import torch

from depthfusion_hf.models.attnres.attnres import attention_residual_with_backend
from depthfusion_hf.models.attnres.shared_sources import attention_residual_from_rows, call_keys, source_logit_rows

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


def check(mix, reference=None):
    """``mix(query, weight, sources) -> h``: its create_graph gradients equal those of ``reference`` (by default
    the reference op over the same sources)."""
    results = []
    if reference is None:
        def reference(w, g, s):
            return attention_residual_with_backend(w, s, g, 1e-6, False, "reference")
    for fn in (mix, reference):
        x, query, weight, sources = dependent_inputs()
        grads = torch.autograd.grad(fn(query, weight, sources).pow(2).sum(), [x, query, weight], create_graph=True)
        second = torch.autograd.grad(sum(g.pow(2).sum() for g in grads), [x, query, weight])
        results.append([g.detach() for g in grads] + list(second))
    for g, w in zip(*results):
        torch.testing.assert_close(g, w, rtol=0, atol=256 * EPS64 * max(1.0, w.abs().max().item()))


def test_op_create_graph_with_dependent_sources(monkeypatch):
    set_small_numel(monkeypatch, -1)  # the custom Function, not the stacked small path
    check(lambda w, g, s: attention_residual_with_backend(w, s, g, 1e-6, False, "torch"))


def test_rows_create_graph_with_dependent_sources():
    """As in the model: a later source is computed from an earlier one's passed view and logit rows (so from the
    keys), and the call reads the passed views."""

    def from_rows(query, weight, sources):
        keys = call_keys([query], [weight])
        row0, passed0 = source_logit_rows(sources[0], keys, 1e-6, pass_source=True)
        row1, passed1 = source_logit_rows((2 * passed0).tanh() + row0, keys, 1e-6, pass_source=True)
        return attention_residual_from_rows([0, 0], [passed0, passed1], [row0, row1], False)

    def reference(query, weight, sources):
        logit = (sources[0] * query * weight).sum(-1, keepdim=True) * torch.rsqrt(sources[0].pow(2).mean(-1,
                                                                                                       keepdim=True)
                                                                                 + 1e-6)
        v1 = (2 * sources[0]).tanh() + logit
        return attention_residual_with_backend(query, [sources[0], v1], weight, 1e-6, False, "reference")

    check(from_rows, reference)
