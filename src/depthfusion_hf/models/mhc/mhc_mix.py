"""The mixing step of manifold-constrained Hyper-Connections (mHC): a sub-layer's output spread over the n
residual streams and added to the mixed streams.

For one token, streams ``X`` [n, D], the sub-layer's output ``f`` [D] and the weights of
:func:`~.mhc_connection.hyper_connection` (``post`` [n], ``comb`` [n, n]):

    X'_k = post_k f + sum_j comb_jk X_j          (X' = post ⊗ f + comb^T X)

``comb`` is applied transposed, as in transformers' ``DeepseekV4DecoderLayer``: ``comb[j, k]`` weighs stream j
in the new stream k.

One entry point, :func:`hyper_mix`, three implementations:

=================  ==========================================================================================
backend            implementation
=================  ==========================================================================================
``"reference"``    :func:`hyper_mix_reference`: the two loops (new stream k, read stream j); autograd.
``"torch"``        :func:`hyper_mix_torch`: one custom autograd Function, a batched [n, n] x [n, D] product per
                   token each way (its backward is written in torch ops: every order of derivative).
``"triton"``       ``mhc_triton.triton_hyper_mix``: one fused kernel each way (the streams read once; the
                   backward writes the gradients of X and f and per-block partial sums for post and comb).
                   First-order only (``create_graph=True`` raises a RuntimeError naming the other backends).
                   Routed to ``"torch"``: float64 work, more than ``TRITON_MAX_STREAMS`` streams, empty inputs.
=================  ==========================================================================================

The backend is resolved as for :func:`~.mhc_connection.hyper_connection` (one ``resolve_backend``, in that file).

Dtypes, decided here for every backend: the result has the promoted dtype of the streams and the output (the
weights do not take part: they are fp32 by design), is accumulated in float32 (float64 when an input is float64)
and rounded once. Autocast does not change it (it is disabled inside): this is the residual update, which under
autocast keeps an fp32 model's streams in fp32, as ``x + f(x)`` keeps a Llama's residual.

This file must stay self-contained (only ``torch`` and same-folder relative imports): it is copied next to the
model code by ``save_pretrained`` for ``trust_remote_code`` loading.
"""

import torch

from .mhc_connection import resolve_backend
from .mhc_inputs import autocast_off, check_streams, check_tensor, weight_dtype

try:  # Triton is optional: the model loads and runs without it.
    from .mhc_triton import MHC_TRITON_DTYPES, TRITON_MAX_STREAMS, triton_hyper_mix
except Exception:  # pragma: no cover - depends on the environment
    MHC_TRITON_DTYPES = ()
    TRITON_MAX_STREAMS = 0
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


class _HyperMix(torch.autograd.Function):
    """The torch backend of :func:`hyper_mix`: ``X' = comb^T X`` (one [n, n] x [n, D] product per token) plus
    ``post ⊗ f`` added in place, saving only references to the inputs. Backward (torch ops, so
    ``create_graph=True`` differentiates it): ``dX = comb dX'``, ``dcomb = X dX'^T``, ``df = post . dX'`` (batched
    products) and ``dpost = dX' . f``."""

    @staticmethod
    def forward(ctx, streams, output, post, comb, dtype):
        acc = weight_dtype(streams, output, post, comb)
        ctx.save_for_backward(streams, output, post, comb)
        mixed = torch.matmul(comb.to(acc).transpose(-1, -2), streams.to(acc))  # (B, T, n, D)
        return mixed.addcmul_(post.to(acc).unsqueeze(-1), output.to(acc).unsqueeze(-2)).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        streams, output, post, comb = ctx.saved_tensors
        acc = weight_dtype(streams, output, post, comb)
        g, x = grad.to(acc), streams.to(acc)
        d_streams = d_output = d_post = d_comb = None
        if ctx.needs_input_grad[0]:
            d_streams = torch.matmul(comb.to(acc), g).to(streams.dtype)  # dX_j = sum_k comb_jk dX'_k
        if ctx.needs_input_grad[1]:
            d_output = torch.matmul(post.to(acc).unsqueeze(-2), g).squeeze(-2).to(output.dtype)
        if ctx.needs_input_grad[2]:
            d_post = torch.linalg.vecdot(g, output.to(acc).unsqueeze(-2)).to(post.dtype)
        if ctx.needs_input_grad[3]:
            d_comb = torch.matmul(x, g.transpose(-1, -2)).to(comb.dtype)  # (B, T, n, n): [j, k] = X_j . dX'_k
        return d_streams, d_output, d_post, d_comb, None


def hyper_mix_torch(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """The vectorised PyTorch backend of :func:`hyper_mix` (:class:`_HyperMix`); the result in ``dtype``."""
    return _HyperMix.apply(streams, output, post, comb, dtype)


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
    choice = resolve_backend(backend, streams.device)
    dtype = torch.promote_types(streams.dtype, output.dtype)
    with autocast_off(streams.device.type):
        if (choice == "triton" and weight_dtype(streams, output, post, comb) == torch.float32
                and dtype in MHC_TRITON_DTYPES and streams.numel() > 0 and streams.shape[2] <= TRITON_MAX_STREAMS):
            return triton_hyper_mix(streams, output, post, comb, dtype)
        if choice == "reference":
            return hyper_mix_reference(streams, output, post, comb, dtype)
        return hyper_mix_torch(streams, output, post, comb, dtype)


__all__ = ["hyper_mix", "hyper_mix_reference", "hyper_mix_torch"]
