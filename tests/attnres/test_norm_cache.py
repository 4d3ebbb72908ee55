"""Per-source norms computed once (``source_inv_rms`` / ``inv_rms=``), and the op without autograd.

The torch backend's list path can take each source's inverse RMS norm as an input (a model computes it
once per source, when the source is written, and passes it to every call reading it); the gradient
through the norm then reaches the source through ``source_inv_rms``. Every check compares with the
reference evaluated in float64 (values, softmax weights, gradients of query, norm weight and sources).
The model checks run the list path (``SMALL_NUMEL = -1``) against the reference backend.
"""

from __future__ import annotations

import pytest
import torch

from depthfusion_hf.models.attnres import AttnResForCausalLM, attnres
from depthfusion_hf.models.attnres.attnres import attention_residual_with_backend, source_inv_rms
from tests.attnres._op_cases import (
    SHAPES,
    check_against_truth,
    error_scales,
    make_grads,
    make_inputs,
    shape_id,
    truth,
)

from .helpers import randomise_attnres, set_small_numel, tiny_config


def run_cached(query, sources, weight, grad_h, grad_alpha, detach_norms=False):
    """The op with ``inv_rms`` from ``source_inv_rms``; ``(h, alpha, [d_query, d_weight, *d_sources])``."""
    norms = [source_inv_rms(v, 1e-6) for v in sources]
    if detach_norms:
        norms = [r.detach() for r in norms]
    h, alpha = attention_residual_with_backend(query, sources, weight, 1e-6, True, "torch", norms)
    grads = torch.autograd.grad([h, alpha], [query, weight, *sources], [grad_h.to(h.dtype), grad_alpha])
    return h, alpha, list(grads)


def test_source_inv_rms_values_and_gradients():
    x = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    r = source_inv_rms(x, 1e-3)
    assert r.shape == (2, 5) and r.dtype == torch.float64
    torch.testing.assert_close(r, torch.rsqrt(x.pow(2).mean(-1) + 1e-3), rtol=1e-14, atol=0)
    assert torch.autograd.gradcheck(lambda v: source_inv_rms(v, 1e-3), (x,))
    assert torch.autograd.gradgradcheck(lambda v: source_inv_rms(v, 1e-3), (x,))
    half = torch.randn(3, 4, dtype=torch.bfloat16)[None]
    assert source_inv_rms(half, 1e-6).dtype == torch.float32  # the op's compute dtype


@pytest.mark.parametrize("detach_norms", [False, True], ids=["norm-grad-via-inv_rms", "detached-inv_rms"])
@pytest.mark.parametrize("shape", SHAPES, ids=[shape_id(s) for s in SHAPES])
def test_cached_norms_match_float64_truth(list_path, shape, detach_norms):
    """fp32; with detached norms the Function itself sends the norm's gradient to the sources."""
    query, sources, weight = make_inputs(shape, torch.float32)
    grad_h, grad_alpha = make_grads(shape, torch.float32)
    result = run_cached(query, sources, weight, grad_h, grad_alpha, detach_norms)
    expected = truth(query, sources, weight, grad_h, grad_alpha)
    check_against_truth(result, expected, torch.float32, error_scales(query, sources, weight, grad_h, grad_alpha))


def test_cached_norms_gradcheck(list_path):
    """First and second order in float64 (the second through the reference, as without the cache)."""
    query, sources, weight = make_inputs((2, 3, 5, 3), torch.float64, param_dtype=torch.float64)

    def fn(q, g, *xs):
        norms = [source_inv_rms(v, 1e-6) for v in xs]
        return attention_residual_with_backend(q, list(xs), g, 1e-6, True, "torch", norms)

    assert torch.autograd.gradcheck(fn, (query, weight, *sources))
    assert torch.autograd.gradgradcheck(fn, (query, weight, *sources))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("shape", SHAPES[:4], ids=[shape_id(s) for s in SHAPES[:4]])
@pytest.mark.parametrize("small", [False, True], ids=["list", "small"])
def test_no_grad_matches_float64_truth(monkeypatch, shape, dtype, small):
    """Under ``torch.no_grad`` (decoding) both torch paths give the truth's values (also under bf16 autocast)."""
    set_small_numel(monkeypatch, 1 << 40 if small else -1)
    query, sources, weight = make_inputs(shape, dtype, param_dtype=dtype if dtype == torch.float64 else torch.float32)
    grad_h, grad_alpha = make_grads(shape, dtype)
    h64, alpha64, _ = truth(query, sources, weight, grad_h, grad_alpha)
    scales = error_scales(query, sources, weight, grad_h, grad_alpha)
    for autocast in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h, alpha = attention_residual_with_backend(query, sources, weight, 1e-6, True, "torch")
        assert h.grad_fn is None
        check_against_truth((h, alpha, []), (h64, alpha64, []), dtype, scales)


def _model_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("block_size", [None, 3])
def test_model_with_cached_norms_matches_reference_backend(list_path, monkeypatch, block_size):
    """Loss and every parameter gradient of the model on the list path with cached norms vs the reference loop.

    Gate (fp32): both sum the same terms in other orders, so the loss agrees to 64 eps relative and each
    gradient to ``64 eps sqrt(n)`` relative in norm (n its element count: random-walk rounding growth).
    Also checks the norms are computed once per written source (1 + 2L), not per call.
    """
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=block_size))
    randomise_attnres(model)
    ids = torch.randint(3, 97, (2, 11))
    calls = []
    original = attnres._InvRms.apply
    monkeypatch.setattr(attnres._InvRms, "apply", lambda *args: calls.append(1) or original(*args))
    loss, grads = _model_grads(model, ids)
    assert len(calls) == 1 + 2 * model.config.num_hidden_layers
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
    ref_loss, ref_grads = _model_grads(model, ids)
    assert len(calls) == 1 + 2 * model.config.num_hidden_layers  # the reference backend does not cache them
    eps = torch.finfo(torch.float32).eps
    assert abs(loss - ref_loss) <= 64 * eps * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        err = (grads[name] - g).norm() / g.norm().clamp_min(1e-30)
        assert err <= 64 * eps * g.numel() ** 0.5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("reentrant", [False, True])
def test_model_with_cached_norms_and_checkpointing(list_path, reentrant):
    """Gradient checkpointing (the norms travel as positional tensors): the same gradients as without."""
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=3))
    randomise_attnres(model)
    ids = torch.randint(3, 97, (2, 8))
    _, plain = _model_grads(model, ids)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    _, checkpointed = _model_grads(model, ids)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(plain[name], checkpointed[name], rtol=1e-5, atol=1e-6)
