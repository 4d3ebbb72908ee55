"""Hypothesis strategies for MoDA attention calls: shapes, strides, dtypes, masks and value scales.

A drawn :class:`Case` is built into the five input views (with the drawn memory layouts: contiguous,
last dim transposed, every other element, a permuted layout, a broadcast head dim, a slice of a larger
token-major depth buffer; the depth as one tensor or as a sequence of its M entries) and a mask. Gradients are
taken with respect to the views themselves.
Shared by ``tests/moda/test_moda_fuzz.py`` (CPU paths) and ``tests/kernels/test_moda_triton.py``
(the Triton kernels, interpreted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

LAYOUTS = ("contiguous", "last_transposed", "every_other", "permuted", "broadcast_heads", "slice")
MASKS = ("none", "bool_padding", "bool_rows", "bool_2d", "additive", "additive_grad", "all_masked")


@dataclass(frozen=True)
class Case:
    """One drawn call: q [B, Hq, T, d], k/v [B, Hkv, S, d], depth [B, Hkv, T, M, d], a mask and a scale."""

    B: int
    Hkv: int
    G: int
    T: int
    S: int
    M: int
    d: int
    dtype: torch.dtype
    causal: bool
    scale: float
    magnitude: float
    layouts: tuple[str, ...]  # for q, k, v, depth_k, depth_v
    mask: str
    mask_transposed: bool
    seed: int
    as_entries: bool  # depth given as a sequence of M entries [B, Hkv, T, d] (views of the drawn layout)

    @property
    def Hq(self) -> int:
        return self.Hkv * self.G


@st.composite
def cases(draw, dtypes=(torch.float32, torch.bfloat16, torch.float64), masks=MASKS, max_t=6, max_d=9) -> Case:
    """A MoDA call: T = 1 and odd sizes, M = 0, GQA groups, S > T (cached), every layout and mask kind."""
    T = draw(st.integers(1, max_t))
    d = draw(st.integers(1, max_d))
    return Case(
        B=draw(st.integers(1, 2)),
        Hkv=draw(st.integers(1, 2)),
        G=draw(st.integers(1, 3)),
        T=T,
        S=T + draw(st.integers(0, 4)),
        M=draw(st.integers(0, 4)),
        d=d,
        dtype=draw(st.sampled_from(dtypes)),
        causal=draw(st.booleans()),
        scale=draw(st.one_of(st.just(d**-0.5), st.floats(-2.0, 2.0), st.just(0.0))),
        magnitude=draw(st.sampled_from([0.5, 1.0, 3.0])),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(5)),
        mask=draw(st.sampled_from(masks)),
        mask_transposed=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        as_entries=draw(st.booleans()),
    )


def _view(values: torch.Tensor, layout: str, gen: torch.Generator, is_depth: bool) -> torch.Tensor:
    """A tensor holding ``values`` (or, for ``broadcast_heads``, head 0 of them) with the given memory layout;
    its autograd leaf is the storage it views."""
    shape = values.shape
    if layout == "last_transposed":
        leaf = values.transpose(-1, -2).contiguous().requires_grad_()
        return leaf.transpose(-1, -2)
    if layout == "every_other":
        leaf = torch.zeros(*shape[:-1], 2 * shape[-1], dtype=values.dtype)
        leaf[..., ::2] = values
        return leaf.requires_grad_()[..., ::2]
    if layout == "permuted":
        order = torch.randperm(values.dim(), generator=gen).tolist()
        leaf = values.permute(order).contiguous().requires_grad_()
        return leaf.permute([order.index(i) for i in range(values.dim())])
    if layout == "broadcast_heads":
        leaf = values[:, :1].clone().requires_grad_()
        return leaf.expand(shape)
    if layout == "slice":
        axis = 3 if is_depth else 2  # depth: M slice of a token-major buffer; q/k/v: positions of a longer one
        pad = 2
        big_shape = list(shape)
        big_shape[axis] += 2 * pad
        leaf = torch.randn(big_shape, generator=gen, dtype=torch.float64).to(values.dtype)
        leaf.narrow(axis, pad, shape[axis]).copy_(values)
        return leaf.requires_grad_().narrow(axis, pad, shape[axis])
    return values.clone().requires_grad_()


def _mask(case: Case, gen: torch.Generator) -> torch.Tensor | None:
    B, Hq, T, S = case.B, case.Hq, case.T, case.S
    kind = case.mask
    if kind == "none":
        return None
    if kind == "bool_padding":  # left padding as the model builds it, [B, 1, 1, S]
        keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
        for b in range(B):
            keep[b, ..., : int(torch.randint(0, S + 1, (1,), generator=gen))] = False
        mask = keep
    elif kind in ("bool_rows", "all_masked"):
        keep = torch.rand(B, Hq, T, S, generator=gen) > 0.4
        keep[:, :, int(torch.randint(0, T, (1,), generator=gen))] = False  # a row with no sequence key
        mask = keep if kind == "bool_rows" else torch.zeros_like(keep)
    elif kind == "bool_2d":
        mask = torch.rand(T, S, generator=gen) > 0.3
    else:
        mask = torch.randn(B, 1, T, S, generator=gen)
        if kind == "additive":
            mask = mask.masked_fill(torch.rand(B, 1, T, S, generator=gen) < 0.3, float("-inf"))
    if case.mask_transposed and mask.dim() >= 2:
        mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "additive_grad":
        mask = mask.requires_grad_()
    return mask


def op_depth(case: Case, inputs: list[torch.Tensor]) -> list:
    """depth_k, depth_v as the op takes them in this case: the 5-d views, or sequences of their M entries."""
    return [list(x.unbind(3)) for x in inputs[3:]] if case.as_entries else inputs[3:]


def build(case: Case) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """(inputs q, k, v, depth_k, depth_v as views with the drawn layouts, mask, upstream gradient [B, Hq, T, d])."""
    gen = torch.Generator().manual_seed(case.seed)
    shapes = [(case.B, case.Hq, case.T, case.d), (case.B, case.Hkv, case.S, case.d), (case.B, case.Hkv, case.S, case.d),
              (case.B, case.Hkv, case.T, case.M, case.d), (case.B, case.Hkv, case.T, case.M, case.d)]
    inputs = []
    for i, (shape, layout) in enumerate(zip(shapes, case.layouts)):
        values = (case.magnitude * torch.randn(shape, generator=gen, dtype=torch.float64)).to(case.dtype)
        inputs.append(_view(values, layout, gen, is_depth=i >= 3))
    grad_out = torch.randn(shapes[0], generator=gen, dtype=torch.float64).to(case.dtype)
    return inputs, _mask(case, gen), grad_out
