"""The op convention and the functional API of moda_attention.py on CPU.

- ``moda_attention_with_backend`` (the unvalidated core) against the validating public op;
- ``moda_forward_saving`` / ``moda_backward_from`` (forward without an autograd graph, backward as a
  function) on depth entries that are strided slices of a token-major buffer, against the reference:
  values and gradients, masks, S > T, T = 1, M = 0, fp32 / bf16 / fp64, gradients added into a
  caller's buffer, and the calls it refuses.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from depthfusion_hf.models.moda.moda_attention import (
    moda_attention,
    moda_attention_with_backend,
    moda_backward_from,
    moda_forward_saving,
    moda_saving_supported,
)
from tests.moda.op_checks import assert_matches_reference

M_MAX = 6


def _case(B=2, Hq=4, Hkv=2, T=5, S=7, d=8, lo=1, hi=4, dtype=torch.float32, seed=0):
    """q, k, v and depth slices ``buffer[:, :, :, lo:hi]`` of token-major [B, Hkv, T, M_MAX, d] buffers."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, d, generator=g).transpose(1, 2).to(dtype)  # the model's transposed view
    k, v = (torch.randn(B, Hkv, S, d, generator=g).to(dtype) for _ in range(2))
    bufs = [torch.randn(B, Hkv, T, M_MAX, d, generator=g).to(dtype) for _ in range(2)]
    return [q, k, v, bufs[0][:, :, :, lo:hi], bufs[1][:, :, :, lo:hi]], bufs


def _mask(kind, B, T, S):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(9)
    keep = torch.rand(B, 1, T, S, generator=g) > 0.3
    keep[0, 0, -1] = False  # a row with no sequence key
    if kind == "bool":
        return keep
    return torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) + 0.2 * torch.randn(keep.shape, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("lo,hi", [(1, 4), (0, M_MAX), (2, 2)], ids=["slice", "whole", "M0"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
@pytest.mark.parametrize("T,S", [(5, 5), (5, 9), (1, 6)])
def test_forward_saving_and_backward_from_match_reference(dtype, lo, hi, mask_kind, T, S):
    inputs, _ = _case(T=T, S=S, lo=lo, hi=hi, dtype=dtype)
    mask = _mask(mask_kind, 2, T, S)
    assert moda_saving_supported(inputs[0], mask, "torch")
    out, saved = moda_forward_saving(*inputs, mask, 0.3, True, "torch")
    assert out.shape == inputs[0].shape and out.dtype == dtype and out.grad_fn is None
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    grads = moda_backward_from(saved, grad)
    assert [g.shape for g in grads] == [x.shape for x in inputs]
    assert all(g.dtype == dtype for g in grads)
    assert_matches_reference(out, grads, inputs, grad, mask, 0.3, True)


def test_inputs_that_require_grad_build_no_graph():
    inputs, _ = _case()
    inputs = [x.requires_grad_() for x in inputs]
    out, saved = moda_forward_saving(*inputs, None, 0.3, True, "torch")
    grads = moda_backward_from(saved, torch.ones_like(out))
    assert out.grad_fn is None and all(g.grad_fn is None for g in grads)


def test_needs_selects_the_gradients():
    inputs, _ = _case()
    out, saved = moda_forward_saving(*inputs, None, 0.3, True, "torch")
    grad = torch.randn(out.shape)
    full = moda_backward_from(saved, grad)
    for needs in [(True, False, False, False, False), (False, True, True, False, False),
                  (False, False, False, True, True), (False, False, False, False, True)]:
        part = moda_backward_from(saved, grad, needs=needs)
        for need, got, want in zip(needs, part, full):
            if not need:
                assert got is None
            else:
                torch.testing.assert_close(got, want)


@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16], ids=["fp32-buffer", "bf16-buffer"])
def test_depth_gradients_added_into_a_buffer(buffer_dtype):
    """``depth_grads_into``: added in place into slices of a gradient buffer; the rest is untouched."""
    inputs, _ = _case(dtype=torch.bfloat16, lo=2, hi=5)
    g = torch.Generator().manual_seed(5)
    grad_bufs = [torch.randn(2, 2, 5, M_MAX, 8, generator=g).to(buffer_dtype) for _ in range(2)]
    before = [b.clone() for b in grad_bufs]
    out, saved = moda_forward_saving(*inputs, None, 0.3, True, "torch")
    grad = torch.randn(out.shape, generator=g).to(torch.bfloat16)
    plain = moda_backward_from(saved, grad)
    into = tuple(b[:, :, :, 2:5] for b in grad_bufs)
    got = moda_backward_from(saved, grad, needs=(True, False, False, False, False), depth_grads_into=into)
    assert got[1] is None and got[3] is into[0] and got[4] is into[1]
    for buf, old, grad_depth in zip(grad_bufs, before, plain[3:]):
        torch.testing.assert_close(buf[:, :, :, 2:5], (old[:, :, :, 2:5].float() + grad_depth.float()).to(buffer_dtype))
        assert torch.equal(buf[:, :, :, :2], old[:, :, :, :2]) and torch.equal(buf[:, :, :, 5:], old[:, :, :, 5:])
    with pytest.raises(ValueError, match="depth_grads_into gk must be a floating tensor of depth_k's shape"):
        moda_backward_from(saved, grad, depth_grads_into=(grad_bufs[0], grad_bufs[1]))


def test_refused_calls_raise_and_are_reported_unsupported():
    inputs, _ = _case()
    needs_grad_mask = torch.zeros(1, 1, 5, 7, requires_grad=True)
    empty = [inputs[0][:, :, :0], inputs[1], inputs[2], inputs[3][:, :, :0], inputs[4][:, :, :0]]
    cases = [
        (inputs, None, "reference"),
        (inputs, needs_grad_mask, "torch"),
        (empty, None, "torch"),
    ]
    for tensors, mask, backend in cases:
        assert not moda_saving_supported(tensors[0], mask, backend)
        with pytest.raises(ValueError, match="moda_forward_saving supports backend='torch' on CPU"):
            moda_forward_saving(*tensors, mask, 0.3, True, backend)
    with torch.no_grad():  # without grad mode the mask's requires_grad does not matter
        assert moda_saving_supported(inputs[0], needs_grad_mask, "torch")
    with FlopCounterMode(display=False):
        assert not moda_saving_supported(inputs[0], None, "torch")
    assert moda_saving_supported(inputs[0], None, "torch")


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_core_matches_the_validating_op(backend):
    inputs, _ = _case()
    mask = _mask("bool", 2, 5, 7)
    want = moda_attention(*inputs, attention_mask=mask, scale=0.3, backend=backend)
    got = moda_attention_with_backend(*inputs, mask, 0.3, True, backend)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same computation, not another kernel
