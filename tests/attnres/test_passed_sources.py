"""The training path's calls pass their sources through (``attention_residual_from_rows(..., pass_sources=True)``):
later calls read the passed views, so each source's gradient is formed in one chain (``alpha_i dh`` added to what
came back through the pass-through output) instead of summed by autograd over its readers; a source's logit rows
are one autograd Function (``_SourceRows``).

Every node still returns complete gradients, so any backward is exact, also one that does not reach the earliest
reader of a source (the hazard of deferring a source's gradient to its earliest reader). Checked in float64
against the reference backend (the loop over sources, autograd's own gradients): the loss and every parameter
gradient for full and block AttnRes, with gradient checkpointing (reentrant and not), and partial backwards
(``torch.autograd.grad`` with respect to the embeddings and a middle layer's parameters only, from a middle call's
softmax weights, and with respect to a passed source itself). The model checks run on the list path
(``SMALL_NUMEL = -1``), where the rows are used.
"""

from __future__ import annotations

import pytest
import torch

from depthfusion_hf.models.attnres import AttnResForCausalLM
from depthfusion_hf.models.attnres.attnres import attnres_reference
from depthfusion_hf.models.attnres.shared_sources import attention_residual_from_rows, call_keys, source_logit_rows

from .helpers import randomise_attnres, tiny_config

EPS64 = torch.finfo(torch.float64).eps


def float64_model(block_size: int | None) -> AttnResForCausalLM:
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=block_size))
    randomise_attnres(model)
    return model.double()


def lm_loss(model, ids, embeds=None):
    out = model.model(inputs_embeds=embeds) if embeds is not None else model.model(ids)
    logits = model.lm_head(out.last_hidden_state)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model, ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close64(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    """float64 gate: the same terms summed in other orders; ``256 eps sqrt(n)`` relative in norm (n elements)."""
    err = (got - want).norm() / want.norm().clamp_min(1e-300)
    assert err <= 256 * EPS64 * want.numel() ** 0.5, f"{name}: relative error {err:.2e}"


def assert_same_function64(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert abs(loss - ref_loss) <= 64 * EPS64 * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, name  # every parameter is reached (the check would be vacuous otherwise)
        assert_close64(grads[name], g, name)


@pytest.mark.parametrize("block_size", [None, 2, 3, 8], ids=lambda s: f"block{s}")
def test_float64_model_matches_reference_backend(list_path, row_calls, monkeypatch, block_size):
    """Loss and every parameter gradient in float64 equal the reference loop's; every call runs from the rows."""
    model = float64_model(block_size)
    ids = torch.randint(3, 97, (2, 9))
    got = loss_and_grads(model, ids)
    assert row_calls["rows"] == 2 * model.config.num_hidden_layers
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
    assert_same_function64(got, loss_and_grads(model, ids))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("block_size", [None, 3], ids=lambda s: f"block{s}")
def test_float64_checkpointing_matches_reference_backend(list_path, row_calls, monkeypatch, block_size, reentrant):
    """Gradient checkpointing (the passed sources travel as the layers' positional outputs): the reference's
    loss and gradients, in float64."""
    model = float64_model(block_size)
    ids = torch.randint(3, 97, (2, 8))
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
    want = loss_and_grads(model, ids)
    monkeypatch.delenv("DEPTHFUSION_BACKEND")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    got = loss_and_grads(model, ids)
    assert row_calls["rows"] >= 2 * model.config.num_hidden_layers
    assert_same_function64(got, want)


@pytest.mark.parametrize("block_size", [None, 3], ids=lambda s: f"block{s}")
def test_partial_backward_equals_reference(list_path, monkeypatch, block_size):
    """``torch.autograd.grad`` with respect to only the embeddings and one middle layer's parameters, and from a
    middle call's softmax weights (a backward that stops at that call, never reaching the later readers of its
    sources, nor for the embeddings' gradient the parameters'): the reference backend's gradients."""
    model = float64_model(block_size)
    ids = torch.randint(3, 97, (2, 9))
    middle = model.model.layers[1]
    params = [middle.mlp_res.query, middle.output_res.key_norm_weight, middle.mlp.down_proj.weight]
    gen = torch.Generator().manual_seed(3)

    def grads():
        embeds = model.model.embed_tokens(ids).detach().requires_grad_()
        full = torch.autograd.grad(lm_loss(model, ids, embeds), [embeds, *params])
        out = model.model(inputs_embeds=embeds, output_depth_weights=True)
        alpha = out.depth_weights[3]  # the call forming layer 1's output (sub-layer 5's input)
        weight = torch.randn(alpha.shape, generator=gen, dtype=alpha.dtype)
        partial = torch.autograd.grad((alpha * weight).sum(), [embeds, params[0]])
        return [*full, *partial]

    got = grads()
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
    gen.manual_seed(3)
    want = grads()
    for i, (g, w) in enumerate(zip(got, want)):
        assert w.abs().sum() > 0
        assert_close64(g, w, f"gradient {i}")


def test_gradient_with_respect_to_a_passed_source():
    """The op level: a call's passed source read by a second call; gradients with respect to the passed view (the
    second call's share only) and to the original (both calls' shares) equal the reference loop's."""
    gen = torch.Generator().manual_seed(5)
    queries = [(0.7 * torch.randn(6, generator=gen, dtype=torch.float64)).requires_grad_() for _ in range(2)]
    weights = [(1 + 0.3 * torch.randn(6, generator=gen, dtype=torch.float64)).requires_grad_() for _ in range(2)]
    sources = [torch.randn(2, 3, 6, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3)]
    keys = call_keys(queries, weights)
    rows = [source_logit_rows(v, keys, 1e-6) for v in sources]
    h0, passed = attention_residual_from_rows([0, 0, 0], sources, rows, False, pass_sources=True)
    assert all(p is not v and torch.equal(p, v) for p, v in zip(passed, sources))
    h1 = attention_residual_from_rows([1, 1, 1], passed, rows, False)
    dh0, dh1 = torch.randn(h0.shape, generator=gen, dtype=h0.dtype), torch.randn(h1.shape, generator=gen,
                                                                                 dtype=h1.dtype)
    loss = (h0 * dh0).sum() + (h1 * dh1).sum()
    got_passed = torch.autograd.grad(loss, passed, retain_graph=True)
    got = torch.autograd.grad(loss, [*sources, *queries, *weights])

    ref_h0, _ = attnres_reference(queries[0], sources, weights[0], 1e-6)
    ref_h1, _ = attnres_reference(queries[1], sources, weights[1], 1e-6)
    ref_loss = (ref_h0 * dh0).sum() + (ref_h1 * dh1).sum()
    want = torch.autograd.grad(ref_loss, [*sources, *queries, *weights])
    # through the passed views only the second call's share flows, except through the rows (computed from the
    # original sources): d/d(passed_i) = alpha_{i,1} dh1
    _, ref_alpha1 = attnres_reference(queries[1], sources, weights[1], 1e-6)
    want_passed = [ref_alpha1[..., i : i + 1] * dh1 for i in range(3)]
    for g, w in zip([*got, *got_passed], [*want, *want_passed]):
        torch.testing.assert_close(g, w, rtol=0, atol=256 * EPS64 * max(1.0, w.abs().max().item()))


def test_source_rows_with_the_source_passed_through():
    """``source_logit_rows(..., pass_source=True)``: the passed view equals the source, and the gradients of the
    source and keys through both outputs (the passed view's added to the rows' in one buffer) equal autograd's
    on the formula ``(v u^T) rsqrt(mean(v^2) + eps)``, also second order."""
    gen = torch.Generator().manual_seed(9)
    source = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64).requires_grad_()
    keys = torch.randn(4, 6, generator=gen, dtype=torch.float64).requires_grad_()
    a, b = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64), torch.randn(2, 3, 6, generator=gen,
                                                                                dtype=torch.float64)

    def fn(v, u):
        rows, passed = source_logit_rows(v, u, 1e-3, pass_source=True)
        assert passed is not v and torch.equal(passed, v)
        return (rows * a).sum() + (passed * passed * b).sum()

    def ref(v, u):
        rows = (v @ u.t()) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-3)
        return (rows * a).sum() + (v * v * b).sum()

    got = torch.autograd.grad(fn(source, keys), (source, keys))
    want = torch.autograd.grad(ref(source, keys), (source, keys))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=256 * EPS64 * max(1.0, w.abs().max().item()))
    assert torch.autograd.gradcheck(fn, (source, keys))
    assert torch.autograd.gradgradcheck(fn, (source, keys))
