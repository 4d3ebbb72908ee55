"""Comparing a MoDA attention path with the float64 reference, with tolerances scaled to dtype and inputs.

The bound on ``rms(got - want)`` has three parts, with ``x`` the largest rms of the inputs (at least 1)
and ``L = max(1, d * x**2 * |scale|)`` the size of a logit:

- ``rtol(dtype) * rms(want)``: rounding of the result itself (outputs and gradients are rounded to the
  input dtype; bf16 kernels also round intermediate probabilities);
- ``ATOL_UNITS * eps(dtype) * L * rms(want)``: a logit of size L carries an absolute rounding error
  ``eps * L``, which exp turns into a relative error of every probability, hence of the result;
- ``ATOL_UNITS * eps(dtype) * floor``: cancellation. Every gradient goes through
  ``dS = P (dP - D)``, a difference of two dot products that cancels exactly when a row sees a single
  entry (then the exact gradient is 0 and any implementation leaves a rounding residue).
  ``floor`` is the size of those terms carried to the gradient, ``rms(dO) * x * L``; for the output
  (a convex combination of values) it is ``x``.

The reference runs in float64 on the very values the tested path saw, so the bound only measures the
tested path's rounding.
"""

from __future__ import annotations

import math

import torch

from depthfusion_hf.models.moda_attention import moda_reference

# Relative RMS bound of the output per input dtype; gradients get GRAD_FACTOR times more (they
# chain three rounded products).
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 4e-3}
GRAD_FACTOR = 4
ATOL_UNITS = 4
NAMES = ("out", "q", "k", "v", "depth_k", "depth_v", "mask")


def rms(x: torch.Tensor) -> float:
    """Root mean square in float64 (0 for an empty tensor)."""
    return x.double().pow(2).mean().sqrt().item() if x.numel() else 0.0


def reference_and_grads(inputs, grad_out, attention_mask, scale, causal):
    """float64 reference output and the gradients of q, k, v, depth_k, depth_v (and the mask when it is a
    float tensor that requires grad) for the upstream gradient ``grad_out``."""
    leaves = [x.detach().double().requires_grad_() for x in inputs]
    mask = attention_mask
    if mask is not None and mask.requires_grad:
        mask = mask.detach().double().requires_grad_()
        leaves.append(mask)
    out = moda_reference(*leaves[:5], mask, scale, causal)
    grads = torch.autograd.grad(out, leaves, grad_out.double(), allow_unused=True)
    return out, [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def bounds(inputs, grad_out, scale, dtype):
    """(logit-rounding relative term, atol of the output, atol of every gradient) for ``inputs`` =
    q, k, v, depth_k, depth_v (see the module docstring)."""
    eps = torch.finfo(dtype).eps
    x = max(1.0, max(rms(t) for t in inputs))
    logit = max(1.0, inputs[0].shape[-1] * x * x * abs(scale))
    return ATOL_UNITS * eps * logit, ATOL_UNITS * eps * x, ATOL_UNITS * eps * rms(grad_out) * x * logit


def assert_matches_reference(out, grads, inputs, grad_out, attention_mask, scale, causal, rtol=None):
    """Assert ``out`` and ``grads`` (q, k, v, depth_k, depth_v[, mask]) match the float64 reference.

    ``grads`` may be shorter than the reference's list (e.g. no mask gradient); None entries are skipped.
    """
    dtype = inputs[0].dtype
    rtol = RTOL[dtype] if rtol is None else rtol
    want_out, want_grads = reference_and_grads(inputs, grad_out, attention_mask, scale, causal)
    rel_logit, atol_out, atol_grad = bounds(inputs, grad_out, scale, dtype)
    checks = [("out", out, want_out, rtol + rel_logit, atol_out)]
    checks += [(name, g, w, GRAD_FACTOR * rtol + rel_logit, atol_grad)
               for name, g, w in zip(NAMES[1:6], grads, want_grads)]
    if len(grads) > 5 and attention_mask is not None:
        # The mask's gradient is rounded to the mask's dtype, which may be coarser than the inputs'.
        coarse = max((dtype, attention_mask.dtype), key=lambda t: torch.finfo(t).eps)
        mask_rtol = rtol if coarse == dtype else RTOL[coarse]
        mask_logit, _, mask_atol = bounds(inputs, grad_out, scale, coarse)
        checks.append(("mask", grads[5], want_grads[5], GRAD_FACTOR * mask_rtol + mask_logit, mask_atol))
    for name, got, want, rel, atol in checks:
        if got is None:
            continue
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.isfinite(got).all(), f"{name}: not finite"
        err = rms(got.double() - want)
        bound = rel * rms(want) + atol
        assert err <= bound, f"{name}: rms error {err:.3e} > {bound:.3e} (rms of reference {rms(want):.3e})"


def default_scale(head_dim: int) -> float:
    """``1 / sqrt(d)``, the op's default logit scale."""
    return 1.0 / math.sqrt(head_dim)
