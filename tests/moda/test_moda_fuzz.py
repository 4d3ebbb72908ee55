"""Property-based fuzz of moda_attention's CPU paths against the float64 reference: values and gradients.

Drawn (tests/moda/fuzz_cases.py): shapes (T = 1, odd sizes, M = 0, GQA groups, S > T), memory layouts of
every input (transposed last dim, strided, permuted, broadcast heads, buffer slices), dtypes (fp32, bf16,
fp64), masks (none, bool padding, bool rows, [T, S], additive with -inf, additive needing a gradient,
all masked), causal or not, scales and value magnitudes. Paths: the fused CPU flash Function, the
materialised path, the public op on backends "torch" and "reference", and the functional
forward / backward API. Tolerances: tests/moda/op_checks.py. The Triton kernels get the same fuzz in
tests/kernels/test_moda_triton.py (interpreted).

Runs derandomised (the same examples on every machine); set ``MODA_FUZZ_EXAMPLES`` to search more.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, given, settings

from depthfusion_hf.models.moda.moda_attention import (
    moda_attention,
    moda_backward_from,
    moda_forward_saving,
    moda_saving_supported,
    moda_torch_flash_cpu,
    moda_torch_math,
)
from tests.moda.fuzz_cases import Case, build, cases
from tests.moda.op_checks import assert_matches_reference

FUZZ = settings(
    max_examples=int(os.environ.get("MODA_FUZZ_EXAMPLES", "60")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _autograd_path(fn, case: Case):
    inputs, mask, grad_out = build(case)
    out = fn(inputs, mask)
    assert out.shape == inputs[0].shape and out.dtype == case.dtype
    wrt = inputs + ([mask] if mask is not None and mask.requires_grad else [])
    grads = torch.autograd.grad(out, wrt, grad_out)
    assert all(g.shape == x.shape for g, x in zip(grads, wrt))
    assert_matches_reference(out, grads, inputs, grad_out, mask, case.scale, case.causal)


@FUZZ
@given(case=cases())
def test_public_op_torch_backend(case):
    _autograd_path(lambda x, mask: moda_attention(*x, attention_mask=mask, scale=case.scale, causal=case.causal,
                                                  backend="torch"), case)


@FUZZ
@given(case=cases(masks=("none", "bool_padding", "bool_rows", "bool_2d", "additive", "all_masked")))
def test_flash_cpu_function(case):
    _autograd_path(lambda x, mask: moda_torch_flash_cpu(*x, mask, case.scale, case.causal), case)


@FUZZ
@given(case=cases())
def test_materialised_path(case):
    _autograd_path(lambda x, mask: moda_torch_math(*x, mask, case.scale, case.causal), case)


@settings(FUZZ, max_examples=max(FUZZ.max_examples // 3, 1))
@given(case=cases(max_t=4, max_d=5))
def test_public_op_reference_backend(case):
    _autograd_path(lambda x, mask: moda_attention(*x, attention_mask=mask, scale=case.scale, causal=case.causal,
                                                  backend="reference"), case)


@FUZZ
@given(case=cases(masks=("none", "bool_padding", "bool_rows", "bool_2d", "additive", "all_masked")))
def test_functional_forward_backward(case):
    inputs, mask, grad_out = build(case)
    assert moda_saving_supported(inputs[0], mask, "torch")
    out, saved = moda_forward_saving(*inputs, mask, case.scale, case.causal, "torch")
    grads = moda_backward_from(saved, grad_out)
    assert [g.shape for g in grads] == [x.shape for x in inputs]
    assert_matches_reference(out, grads, inputs, grad_out, mask, case.scale, case.causal)
