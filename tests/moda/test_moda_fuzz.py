"""Property-based fuzz of moda_attention's CPU backends against the float64 reference: values and gradients.

Drawn (tests/moda/fuzz_cases.py): shapes (T = 1, odd sizes, M = 0, GQA groups, S > T), memory layouts of
every input (transposed last dim, strided, permuted, broadcast heads, buffer slices; the depth as one tensor or
as its entries), dtypes (fp32, bf16, fp64), masks (none, bool padding, bool rows, [T, S], additive with -inf,
additive needing a gradient, all masked), causal or not, scales (zero and negative included) and value
magnitudes. Backends "torch" (both of its sequence-pool forms: the fused CPU kernel without a mask, the
materialised pool with one) and "reference". Tolerances: tests/moda/op_checks.py. The Triton kernels get the
same fuzz in tests/kernels/test_moda_triton.py (interpreted).

Runs derandomised (the same examples on every machine); set ``MODA_FUZZ_EXAMPLES`` to search more.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from depthfusion_hf.models.moda_attention import moda_attention
from tests.moda.fuzz_cases import Case, build, cases, op_depth
from tests.moda.op_checks import assert_matches_reference

FUZZ = settings(
    max_examples=int(os.environ.get("MODA_FUZZ_EXAMPLES", "60")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def check(case, backend):
    inputs, mask, grad_out = build(case)
    out = moda_attention(*inputs[:3], *op_depth(case, inputs), attention_mask=mask, scale=case.scale,
                         causal=case.causal, backend=backend)
    assert out.shape == inputs[0].shape and out.dtype == case.dtype
    wrt = inputs + ([mask] if mask is not None and mask.requires_grad else [])
    grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=case.M == 0 and case.as_entries)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, wrt)]
    assert all(g.shape == x.shape for g, x in zip(grads, wrt))
    assert_matches_reference(out, grads, inputs, grad_out, mask, case.scale, case.causal)


@FUZZ
@given(case=cases())
def test_public_op_torch_backend(case):
    check(case, "torch")


@settings(FUZZ, max_examples=max(FUZZ.max_examples // 3, 1))
@given(case=cases(max_t=4, max_d=5))
def test_public_op_reference_backend(case):
    check(case, "reference")


@pytest.mark.parametrize("seed", range(3))
def test_the_fuzz_detects_a_wrong_op(seed):
    """The comparison can fail: with the depth entries' values swapped between tokens it does."""
    case = Case(B=1, Hkv=2, G=2, T=4, S=5, M=2, d=6, dtype=torch.float64, causal=True, scale=0.4, magnitude=1.0,
                layouts=("contiguous",) * 5, mask="none", mask_transposed=False, seed=seed, as_entries=True)
    inputs, mask, grad_out = build(case)
    out = moda_attention(*inputs[:3], inputs[3], inputs[4].flip(2), backend="torch")
    grads = torch.autograd.grad(out, inputs, grad_out)
    with pytest.raises(AssertionError):
        assert_matches_reference(out, grads, inputs, grad_out, mask, case.scale, case.causal)
