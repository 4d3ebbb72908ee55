"""``moda_attention`` under ``create_graph=True`` with inputs that depend on one another (found by review): the
custom backwards answer a second-order backward by recomputing the formula and differentiating it with
``torch.autograd.grad`` with respect to their saved inputs; when one input is computed from another (keys from the
queries, depth entries from the keys) that is the total derivative through the caller's graph, and every
gradient, first order included, came out wrong. Checked against the reference backend in float64: the first-order
gradient taken with ``create_graph=True`` and a second-order gradient through it.
"""

from __future__ import annotations

import pytest
import torch

from depthfusion_hf.models.moda_attention import moda_attention

EPS64 = torch.finfo(torch.float64).eps


def first_and_second_order(x: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, tokens, head_dim, entries = x.shape[0], x.shape[1], x.shape[2], x.shape[3], 2
    q = 1.5 * x
    k = q.tanh()  # the keys depend on the queries
    v = x.sin()
    depth_k = 0.7 * k.unsqueeze(3).expand(batch, heads, tokens, entries, head_dim)  # the entries on the keys
    depth_v = v.unsqueeze(3).expand(batch, heads, tokens, entries, head_dim).cos()
    out = moda_attention(q, k, v, depth_k, depth_v, backend=backend)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), [x], create_graph=True)
    (second,) = torch.autograd.grad(grad.pow(2).sum(), [x])
    return grad.detach(), second


@pytest.mark.parametrize("backend", ["torch"])
def test_create_graph_with_dependent_inputs_equals_reference(backend):
    x = torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    got = first_and_second_order(x, backend)
    want = first_and_second_order(x, "reference")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=256 * EPS64 * max(1.0, w.abs().max().item()))
