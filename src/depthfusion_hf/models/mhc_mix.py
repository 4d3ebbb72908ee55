"""The mixing step of mHC (``../shared/PAPERS.md`` §5): a sub-layer's output ``f`` [D] spread over a token's
streams ``X`` [n, D] by ``post`` [n] and added to the streams mixed by ``comb`` [n, n] (from
:func:`~.mhc_connection.hyper_connection`), ``comb`` applied transposed as in transformers' ``DeepseekV4DecoderLayer``:

    X'_k = post_k f + sum_j comb_jk X_j          (X' = post ⊗ f + comb^T X)

=================  ==========================================================================================
backend            implementation
=================  ==========================================================================================
``"reference"``    :func:`hyper_mix_reference`: the two loops (new stream k, read stream j); autograd.
``"torch"``        :func:`hyper_mix_torch`: a batched [n, n] x [n, D] product per token (:func:`_mixed`), in the
                   custom Function :class:`_HyperMix` (backward in torch ops: every order) when a gradient is
                   wanted.
``"triton"``       ``mhc_triton.triton_hyper_mix``: one fused kernel each way. First order only. Routed to
                   ``"torch"``: float64 work, more than ``TRITON_MAX_STREAMS`` streams, empty inputs.
=================  ==========================================================================================

The backend is resolved by ``mhc_connection.resolve_backend``. Dtypes, for every backend: the result has the
promoted dtype of the streams and the output (the weights are fp32 by design), accumulated in float32 (float64
when an input is float64) and rounded once; autocast is disabled inside (the residual update keeps an fp32
model's streams fp32, as ``x + f(x)`` keeps a Llama's residual).

Self-contained (``torch`` and same-folder imports only): ``save_pretrained`` copies it next to the model code.
"""

import torch

from .mhc_connection import resolve_backend, triton_computes
from .mhc_inputs import autocast_off, cast, check_streams, check_tensor, weight_dtype

try:  # Triton is optional: the model loads and runs without it.
    from .mhc_triton import triton_hyper_mix
except Exception:  # pragma: no cover - depends on the environment
    triton_hyper_mix = None


def check_hyper_mix_inputs(streams, output, post, comb) -> None:
    """Raise a ValueError naming the argument unless every backend computes these inputs correctly (no sync)."""
    batch, tokens, n, dim = check_streams(streams)
    device = streams.device
    check_tensor("output", output, (batch, tokens, dim), device, "[B, T, D]")
    check_tensor("post", post, (batch, tokens, n), device, "[B, T, n]")
    check_tensor("comb", comb, (batch, tokens, n, n), device, "[B, T, n, n]")


def hyper_mix_reference(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """The loops ``X'_k = post_k f + sum_j comb_jk X_j``, accumulated in :func:`weight_dtype`, rounded to ``dtype``."""
    acc = weight_dtype(streams, output, post, comb)
    f = output.to(acc)
    new = []
    for k in range(streams.shape[-2]):
        stream = post[..., k, None].to(acc) * f
        for j in range(streams.shape[-2]):
            stream = stream + comb[..., j, k, None].to(acc) * streams[..., j, :].to(acc)
        new.append(stream)
    return torch.stack(new, dim=-2).to(dtype)


def _mixed(streams, output, post, comb, dtype):
    """``comb^T X`` (one [n, n] x [n, D] product per token) plus ``post ⊗ f`` added in place, rounded to ``dtype``.

    The 4-D ``matmul`` (not a 3-D ``bmm`` / ``baddbmm`` of the same products: 1.8x / 4-7x slower at 1,024 tokens)."""
    acc = weight_dtype(streams, output, post, comb)
    mixed = torch.matmul(cast(comb, acc).transpose(-1, -2), cast(streams, acc))  # (B, T, n, D)
    return cast(mixed.addcmul_(cast(post, acc).unsqueeze(-1), cast(output, acc).unsqueeze(-2)), dtype)


class _HyperMix(torch.autograd.Function):
    """The torch backend of :func:`hyper_mix` when a gradient is wanted: :func:`_mixed`, saving only references to
    the inputs. Backward (torch ops, so ``create_graph=True`` differentiates it): ``dX = comb dX'``, ``dcomb = X
    dX'^T``, ``df = post . dX'`` and ``dpost = dX' f`` (batched products)."""

    @staticmethod
    def forward(ctx, streams, output, post, comb, dtype):
        ctx.save_for_backward(streams, output, post, comb)
        return _mixed(streams, output, post, comb, dtype)

    @staticmethod
    def backward(ctx, grad):
        streams, output, post, comb = ctx.saved_tensors
        acc = weight_dtype(streams, output, post, comb)
        g = cast(grad, acc)
        d_streams = d_output = d_post = d_comb = None
        if ctx.needs_input_grad[0]:
            d_streams = cast(torch.matmul(cast(comb, acc), g), streams.dtype)  # dX_j = sum_k comb_jk dX'_k
        if ctx.needs_input_grad[1]:
            d_output = cast(torch.matmul(cast(post, acc).unsqueeze(-2), g).squeeze(-2), output.dtype)
        if ctx.needs_input_grad[2]:
            d_post = cast(torch.matmul(g, cast(output, acc).unsqueeze(-1)).squeeze(-1), post.dtype)
        if ctx.needs_input_grad[3]:
            d_comb = cast(torch.matmul(cast(streams, acc), g.transpose(-1, -2)), comb.dtype)  # [j, k] = X_j . dX'_k
        return d_streams, d_output, d_post, d_comb, None


def hyper_mix_torch(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """The vectorised PyTorch backend of :func:`hyper_mix` (:class:`_HyperMix` when autograd records and an input
    wants a gradient, else :func:`_mixed`); the result in ``dtype``."""
    if torch.is_grad_enabled() and (streams.requires_grad or output.requires_grad or post.requires_grad
                                    or comb.requires_grad):
        return _HyperMix.apply(streams, output, post, comb, dtype)
    return _mixed(streams, output, post, comb, dtype)


def hyper_mix(
    streams: torch.Tensor,
    output: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """The new streams after a sub-layer: ``X'_k = post_k f + sum_j comb_jk X_j`` (see the module docstring).

    Differentiable in every argument (every order on ``"reference"`` and ``"torch"``, first order on ``"triton"``).

    Args:
        streams: [B, T, n, D], the streams the sub-layer's input was collapsed from (any strides).
        output: [B, T, D], the sub-layer's output f.
        post: [B, T, n] and comb: [B, T, n, n], from :func:`~.mhc_connection.hyper_connection`.
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` or None (see ``resolve_backend``).
    Returns:
        [B, T, n, D] in the promoted dtype of ``streams`` and ``output``.
    Raises:
        ValueError: a shape, dtype or device that does not fit (naming the argument), or a backend that is
            unknown or cannot run on the streams' device.
    """
    check_hyper_mix_inputs(streams, output, post, comb)
    return hyper_mix_core(resolve_backend(backend, streams.device), streams, output, post, comb)


def hyper_mix_core(backend: str, streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor,
                   comb: torch.Tensor) -> torch.Tensor:
    """:func:`hyper_mix` on a resolved ``backend`` without the input check: for a model, which resolves the backend
    once per forward and passes its own (valid) tensors. Same shapes and results."""
    dtype = torch.promote_types(streams.dtype, output.dtype)
    with autocast_off(streams.device.type):
        if backend == "triton" and triton_computes(streams, weight_dtype(streams, output, post, comb), dtype):
            return triton_hyper_mix(streams, output, post, comb, dtype)
        if backend == "reference":
            return hyper_mix_reference(streams, output, post, comb, dtype)
        return hyper_mix_torch(streams, output, post, comb, dtype)


__all__ = ["hyper_mix", "hyper_mix_core", "hyper_mix_reference", "hyper_mix_torch"]
