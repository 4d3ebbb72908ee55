"""A depth-fusion op under ``create_graph=True`` with inputs that depend on one another and on the call's parameters
(found by review): a custom backward answers a second-order backward by recomputing its formula and differentiating
it with respect to its saved inputs; when one input is computed from another (keys from the queries, a later source
from an earlier one and from the query, mHC's fn from the streams) that must be the total derivative through the
caller's graph. Checked against the reference backend in float64, for each family whose op has a custom backward,
on every forward path of its entry in ``tests/family_cases.py``: the first-order gradients taken with
``create_graph=True`` and a second-order gradient through them."""

from __future__ import annotations

import pytest
import torch

from depthfusion_hf.models.attnres import attention_residual
from depthfusion_hf.models.mhc_connection import hyper_connection
from depthfusion_hf.models.moda_attention import moda_attention
from tests.family_cases import path_params
from tests.mhc.helpers import op_inputs

EPS64 = torch.finfo(torch.float64).eps


def attnres_loss(backend: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(loss, leaves): AttnRes over sources [v0, v1, v0 * v1], v1 computed from v0 and from the query."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64).requires_grad_()
    query = (0.5 * torch.randn(6, generator=gen, dtype=torch.float64)).requires_grad_()
    weight = (1 + 0.3 * torch.randn(6, generator=gen, dtype=torch.float64)).requires_grad_()
    v0 = x.sin()
    v1 = (v0 * 2).tanh() + query
    return attention_residual(query, [v0, v1, v0 * v1], weight, backend=backend).pow(2).sum(), [x, query, weight]


def moda_loss(backend: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(loss, leaves): MoDA attention whose keys are computed from the queries and depth entries from the keys."""
    x = torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    batch, heads, tokens, head_dim, entries = *x.shape, 2
    q = 1.5 * x
    k = q.tanh()
    v = x.sin()
    depth_k = 0.7 * k.unsqueeze(3).expand(batch, heads, tokens, entries, head_dim)
    depth_v = v.unsqueeze(3).expand(batch, heads, tokens, entries, head_dim).cos()
    return moda_attention(q, k, v, depth_k, depth_v, backend=backend).pow(2).sum(), [x]


def mhc_loss(backend: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(loss, leaves): an mHC connection whose fn and base are computed from the streams."""
    streams, fn, base, scale = op_inputs(2, 3, 3, 5)
    post, comb, collapsed = hyper_connection(streams, fn * streams.mean(), base + streams.sum(), scale,
                                             sinkhorn_iters=4, eps=1e-6, norm_eps=1e-6, backend=backend)
    return (post * post).sum() + (comb * comb).sum() + collapsed.sin().sum(), [streams]


# family -> (loss function, bound of the first-order and of the second-order gradients in eps64 of their scale)
OPS = {"moda": (moda_loss, 256, 256), "attnres": (attnres_loss, 256, 256), "mhc": (mhc_loss, 256, 1024)}


def first_and_second_order(loss_fn, backend: str) -> list[torch.Tensor]:
    loss, leaves = loss_fn(backend)
    first = torch.autograd.grad(loss, leaves, create_graph=True)
    second = torch.autograd.grad(sum(g.pow(2).sum() for g in first), leaves)
    return [g.detach() for g in first] + list(second)


@pytest.mark.parametrize(("family", "path"), [p for p in path_params() if p.values[0] in OPS])
def test_create_graph_with_dependent_inputs_equals_reference(monkeypatch, family, path):
    if path is not None:
        path(monkeypatch)
    loss_fn, first_ulps, second_ulps = OPS[family]
    got, want = first_and_second_order(loss_fn, "torch"), first_and_second_order(loss_fn, "reference")
    orders = len(got) // 2
    for i, (g, w) in enumerate(zip(got, want)):
        ulps = first_ulps if i < orders else second_ulps
        err, scale = (g - w).abs().max().item(), w.abs().max().item()
        assert err <= ulps * EPS64 * scale, f"{'first' if i < orders else 'second'}-order gradient {i % orders}: " \
            f"max |diff| {err:.3g} over scale {scale:.3g}"
