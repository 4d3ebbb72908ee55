"""Mixture-of-Depths Attention (MoDA), the op behind the MoDA family (arXiv 2603.15619).

A query token attends, in ONE softmax with one scale, to

- the causal sequence keys/values of its layer (``k``, ``v``: the usual attention pool), and
- its own ``M`` depth keys/values (``depth_k``, ``depth_v``: entries written for the *same token* by
  earlier layers). Depth entries of other tokens are never visible.

Three implementations behind :func:`moda_attention`, one signature:

- ``"reference"``: loops over batch, head and token, obviously correct, autograd does the rest.
- ``"torch"``: vectorised (no Python loop over tokens or layers), two implementations:

  - on CPU (:func:`moda_torch_flash_cpu`): the sequence pool through SDPA's fused flash kernel
    (``aten._scaled_dot_product_flash_attention_for_cpu``, which also returns the row log-sum-exp),
    the depth pool as small batched products, merged exactly by log-sum-exp in one custom autograd
    Function whose backward reuses the kernel's backward (no [T, S] matrix is kept);
  - elsewhere, under a Python dispatch mode, or with a mask that needs a gradient
    (:func:`moda_torch_math`): sequence logits [.., T, S] and depth logits [.., T, M] concatenated
    along the last dim, one softmax, split.

  GQA reshapes the queries to [B, Hkv, G, T, d] instead of copying keys with ``repeat_interleave``.
- ``"triton"``: a fused kernel (``moda_triton.py``) for CUDA tensors, used when Triton imports.

The backend is chosen by the ``backend`` argument, else the ``DEPTHFUSION_BACKEND`` environment
variable, else automatically (Triton for CUDA tensors when available, PyTorch otherwise).

One convention for callers:

- :func:`moda_attention` validates the inputs, resolves the backend and calls
  :func:`moda_attention_with_backend`, the unvalidated core a model calls after resolving once per
  forward. The core routes what a kernel cannot compute: float64 and a float mask that needs a
  gradient go from Triton to the PyTorch path (``moda_triton.py`` never imports this module).
- Every path is differentiable twice: the custom Functions (CPU flash, Triton) compute second-order
  gradients by recomputing the materialised :func:`moda_torch_math` under ``create_graph=True``.
- :func:`moda_forward_saving` / :func:`moda_backward_from`: the forward without an autograd graph and
  its backward as plain functions (CPU flash path and Triton), for a caller that owns the backward of a
  whole pass (the model's depth stream); depth entries may be strided views of a larger buffer.

This file must stay self-contained (only ``torch`` and same-folder relative imports): it is
copied next to the model code by ``save_pretrained`` for ``trust_remote_code`` loading.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


# Copied from depthfusion_hf.models.denseformer.dwa.triton_unavailable
def triton_unavailable(*_args: object) -> bool:
    """Stands in for the kernel module's availability checks when it does not import: the kernel runs nowhere."""
    return False


try:  # Triton is optional: the model loads and runs without it.
    from .moda_triton import (
        TRITON_MODA_DTYPES,
        moda_triton_available,
        moda_triton_runs_on,
        triton_moda_attention,
        triton_moda_backward,
        triton_moda_forward,
    )
except Exception:  # pragma: no cover - depends on the environment
    TRITON_MODA_DTYPES = ()
    triton_moda_attention = triton_moda_forward = triton_moda_backward = None
    moda_triton_available = moda_triton_runs_on = triton_unavailable


BACKENDS = ("reference", "torch", "triton")
BACKEND_ENV_VAR = "DEPTHFUSION_BACKEND"
# The dtypes every path computes correctly; others (integers, complex, float8) are rejected, not rounded.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# Copied from depthfusion_hf.models.denseformer.dwa.resolve_backend with _forward_backward->, dwa_->moda_
def resolve_backend(backend: str | None, device: torch.device, config_backend: str | None = None) -> str:
    """Pick the implementation of the op: the one place that decides.

    ========================  =====================================================================
    precedence                where it comes from
    ========================  =====================================================================
    1. ``backend``            the op's ``backend=`` argument
    2. ``$DEPTHFUSION_BACKEND``  the environment variable (an override for a whole process)
    3. ``config_backend``     the model config's ``op_backend`` field (a model passes it)
    4. automatic              Triton for CUDA tensors when the kernel imports, else PyTorch
    ========================  =====================================================================

    A model calls this once per forward pass and device with ``backend=None``; that choice is logged at DEBUG
    (an explicit ``backend`` is not logged: ops called with a resolved backend stay silent).

    Args:
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` (any case) or None.
        device: the device of the op's tensors.
        config_backend: the config's ``op_backend`` (same values), used when neither ``backend`` nor the
            environment variable is set.
    Returns:
        ``"reference"``, ``"torch"`` or ``"triton"``.
    Raises:
        ValueError: for an unknown name, or ``"triton"`` where the kernel cannot run (no Triton, or
            tensors on a device other than CUDA without ``TRITON_INTERPRET=1``).
    """
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV_VAR) or config_backend or "auto"
    if not isinstance(choice, str):
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS} or None; got {choice!r}")
    choice = choice.lower()
    if choice == "auto":
        use_triton = device.type == "cuda" and moda_triton_available()
        choice = "triton" if use_triton else "torch"
    elif choice not in BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {choice!r}")
    elif choice == "triton" and not moda_triton_available():
        raise ValueError("backend='triton' was requested but Triton (or its kernel module) is not available")
    elif choice == "triton" and not moda_triton_runs_on(device):
        raise ValueError(
            f"backend='triton' runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); got device {device}"
        )
    if backend is None:
        logger.debug("%s: backend %r on %s", __name__, choice, device)
    return choice


def _shape(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def check_moda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> None:
    """Raise a ValueError naming the argument and the expected shape, dtype or device when the inputs do not
    fit together (k, v, depth_k, depth_v share q's dtype, one of ``DTYPES``, and its device; the mask is
    bool or floating, on q's device)."""
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, Hq, T, d]; got {_shape(q)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q must have a floating dtype in {DTYPES}; got {q.dtype}")
    batch, num_q_heads, q_len, head_dim = q.shape
    if k.dim() != 4:
        raise ValueError(f"k must have shape [B, Hkv, S, d]; got {_shape(k)}")
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k must have shape [B={batch}, Hkv, S, d={head_dim}]; got {_shape(k)}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"k must have Hkv heads with Hq={num_q_heads} a multiple of Hkv; got {_shape(k)}")
    if kv_len < q_len:
        raise ValueError(f"k must have S >= T={q_len} positions (queries are the last T of S); got {_shape(k)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k, {_shape(k)}; got {_shape(v)}")
    if depth_k.dim() != 5:
        raise ValueError(f"depth_k must have shape [B, Hkv, T, M, d]; got {_shape(depth_k)}")
    expected = (batch, num_kv_heads, q_len, depth_k.shape[3], head_dim)
    if _shape(depth_k) != expected:
        raise ValueError(f"depth_k must have shape [B, Hkv, T, M, d] = {expected}; got {_shape(depth_k)}")
    if depth_v.shape != depth_k.shape:
        raise ValueError(f"depth_v must have the shape of depth_k, {_shape(depth_k)}; got {_shape(depth_v)}")
    for name, x in (("k", k), ("v", v), ("depth_k", depth_k), ("depth_v", depth_v)):
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(
                f"{name} must share q's dtype and device ({q.dtype}, {q.device}); got {x.dtype}, {x.device}"
            )
    if attention_mask is not None:
        target = (batch, num_q_heads, q_len, kv_len)
        try:
            broadcast = torch.broadcast_shapes(attention_mask.shape, target)
        except RuntimeError:
            broadcast = None
        if attention_mask.dim() > 4 or broadcast != target:
            raise ValueError(
                f"attention_mask must be broadcastable to [B, Hq, T, S] = {target}; got {_shape(attention_mask)}"
            )
        if attention_mask.dtype != torch.bool and attention_mask.dtype not in DTYPES:
            raise ValueError(
                f"attention_mask must be bool (True = attend) or additive float {DTYPES}; got {attention_mask.dtype}"
            )
        if attention_mask.device != q.device:
            raise ValueError(f"attention_mask must be on q's device {q.device}; got {attention_mask.device}")


def _causal_keep(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[T, S] bool: query ``t`` (position ``S - T + t``) may see key ``j`` iff ``j <= S - T + t``."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
    return torch.arange(kv_len, device=device).unsqueeze(0) <= rows


def _masked_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim that returns zeros (not NaN) for rows whose entries are all ``-inf``."""
    row_max = logits.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(logits - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


def moda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """The definition, one (batch, head, token) at a time, in float32 (float64 stays float64).

    Args:
        q: [B, Hq, T, d]; k, v: [B, Hkv, S, d]; depth_k, depth_v: [B, Hkv, T, M, d].
        attention_mask: None, bool (True = attend) or additive float, broadcastable to [B, Hq, T, S].
    Returns:
        [B, Hq, T, d] in q's dtype.
    """
    batch, num_q_heads, q_len, _ = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    mask = None
    if attention_mask is not None:
        mask = attention_mask.expand(batch, num_q_heads, q_len, kv_len)
    rows = []
    for b in range(batch):
        heads = []
        for h in range(num_q_heads):
            kv = h // group
            tokens = []
            for t in range(q_len):
                visible = kv_len - q_len + t + 1 if causal else kv_len
                query = q[b, h, t].to(work)
                seq_logits = (k[b, kv, :visible].to(work) @ query) * scale  # (visible,)
                if mask is not None:
                    row_mask = mask[b, h, t, :visible]
                    if row_mask.dtype == torch.bool:
                        seq_logits = seq_logits.masked_fill(~row_mask, float("-inf"))
                    else:
                        seq_logits = seq_logits + row_mask.to(work)
                depth_logits = (depth_k[b, kv, t].to(work) @ query) * scale  # (M,)
                weights = _masked_softmax(torch.cat([seq_logits, depth_logits]))
                out = weights[:visible] @ v[b, kv, :visible].to(work)
                out = out + weights[visible:] @ depth_v[b, kv, t].to(work)
                tokens.append(out)
            heads.append(torch.stack(tokens))
        rows.append(torch.stack(heads))
    return torch.stack(rows).to(q.dtype)


def moda_joint_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    depth_k: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """The joint softmax weights over ``[sequence keys | depth keys]``, vectorised.

    Args:
        q: [B, Hq, T, d]; k: [B, Hkv, S, d]; depth_k: [B, Hkv, T, M, d].
    Returns:
        [B, Hkv, G, T, S + M] float32 (float64 for float64 inputs), G = Hq / Hkv; query head
        ``h`` is ``[:, h // G, h % G]``. Rows with no visible entry are all zeros.
    """
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    # GQA without copies: query head h = kv * G + g, so [B, Hq, T, d] -> [B, Hkv, G * T, d].
    q_rows = q.reshape(batch, num_kv_heads, group * q_len, head_dim)
    seq_logits = (q_rows @ k.transpose(-1, -2)).to(work) * scale  # (B, Hkv, G*T, S)
    seq_logits = seq_logits.view(batch, num_kv_heads, group, q_len, kv_len)
    if causal:
        keep = _causal_keep(q_len, kv_len, q.device)  # (T, S)
        seq_logits = seq_logits.masked_fill(~keep, float("-inf"))
    if attention_mask is not None:
        mask = attention_mask.expand(batch, num_q_heads, q_len, kv_len)
        mask = mask.reshape(batch, num_kv_heads, group, q_len, kv_len)
        if mask.dtype == torch.bool:
            seq_logits = seq_logits.masked_fill(~mask, float("-inf"))
        else:
            seq_logits = seq_logits + mask.to(work)
    # Depth pool: token t of query head (kv, g) reads depth_k[:, kv, t]. (B, Hkv, T, G, d) @ (B, Hkv, T, d, M)
    q_tokens = q.reshape(batch, num_kv_heads, group, q_len, head_dim).transpose(2, 3)
    depth_logits = (q_tokens @ depth_k.transpose(-1, -2)).to(work) * scale  # (B, Hkv, T, G, M)
    depth_logits = depth_logits.transpose(2, 3)  # (B, Hkv, G, T, M)
    return _masked_softmax(torch.cat([seq_logits, depth_logits], dim=-1))


def moda_torch_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """Vectorised MoDA, materialised: one joint softmax (see :func:`moda_joint_probs`), then both weighted sums.

    Holds the [B, Hq, T, S + M] probabilities (and autograd keeps several such tensors); any device,
    twice differentiable. :func:`moda_torch` uses it where the fused CPU path does not apply.

    Args:
        q: [B, Hq, T, d]; k, v: [B, Hkv, S, d]; depth_k, depth_v: [B, Hkv, T, M, d].
    Returns:
        [B, Hq, T, d] in q's dtype.
    """
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    probs = moda_joint_probs(q, k, depth_k, attention_mask, scale, causal)  # (B, Hkv, G, T, S + M)
    seq_probs, depth_probs = probs.split([kv_len, probs.shape[-1] - kv_len], dim=-1)
    seq_probs = seq_probs.to(v.dtype).reshape(batch, num_kv_heads, group * q_len, kv_len)
    out = (seq_probs @ v).view(batch, num_kv_heads, group, q_len, head_dim).to(probs.dtype)
    depth_probs = depth_probs.to(depth_v.dtype).transpose(2, 3)  # (B, Hkv, T, G, M)
    depth_out = (depth_probs @ depth_v).transpose(2, 3)  # (B, Hkv, G, T, d)
    out = out + depth_out.to(probs.dtype)
    return out.reshape(batch, num_q_heads, q_len, head_dim).to(q.dtype)


# The fused CPU flash-attention op of SDPA, which also returns the row log-sum-exp (absent in old builds).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_FLASH_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _sequence_mask(
    attention_mask: torch.Tensor | None, causal: bool, q_len: int, kv_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor | None, bool, torch.Tensor | None]:
    """The sequence-pool masking in the form the CPU flash kernel takes.

    Returns ``(mask, is_causal, empty_rows)``: ``mask`` None or an additive 4-d mask in ``dtype``
    broadcastable to [B, Hq, T, S]; ``is_causal`` for the kernel's own (top-left aligned, so only
    exact when S = T) causal mask; ``empty_rows`` None or bool [b, h, T] (broadcastable to [B, Hq, T]),
    True where a query row sees no sequence key at all (the kernel returns a log-sum-exp of 0 there).
    """
    is_causal = causal and q_len == kv_len
    keep = None
    if causal and q_len != kv_len and q_len > 1:  # bottom-right aligned causality: an explicit mask
        keep = _causal_keep(q_len, kv_len, torch.device("cpu"))  # (T, S)
    if attention_mask is None and keep is None:
        return None, is_causal, None
    if attention_mask is None:
        mask = torch.zeros(q_len, kv_len, dtype=dtype)
    elif attention_mask.dtype == torch.bool:
        mask = torch.zeros(attention_mask.shape, dtype=dtype).masked_fill(~attention_mask, float("-inf"))
    else:
        mask = attention_mask.detach().to(dtype)
    if keep is not None:
        mask = mask.masked_fill(~keep, float("-inf"))
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    empty_rows = None
    if attention_mask is not None:
        visible = mask > float("-inf")
        if is_causal:
            visible = visible & _causal_keep(q_len, kv_len, torch.device("cpu"))
        empty = ~visible.any(dim=-1)  # (b, h, T)
        if bool(empty.any()):
            empty_rows = empty
    return mask, is_causal, empty_rows


def _unit_stride_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is unit-stride, else a contiguous copy: the CPU flash kernel
    assumes a unit stride there and returns garbage otherwise (any other stride, 0 included, is read right)."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _flash_cpu_forward(q, k, v, depth_k, depth_v, mask, is_causal, empty_rows, scale):
    """The fused CPU forward without autograd: ``(out [B, Hq, T, d], (lse_kernel, alpha, probs))``.

    ``q``, ``k``, ``v`` must have a unit-stride last dim (see :func:`_unit_stride_last`); the depth
    tensors may have any strides. ``mask``, ``is_causal``, ``empty_rows`` from :func:`_sequence_mask`.
    """
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    out_seq, lse_kernel = _FLASH_CPU(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse_seq = lse_kernel.to(work)  # (B, Hq, T)
    if empty_rows is not None:
        lse_seq = lse_seq.masked_fill(empty_rows, float("-inf"))
        out_seq = out_seq.masked_fill(empty_rows.unsqueeze(-1), 0.0)  # alpha is 0 there: keep 0 * out finite
    lse_seq = lse_seq.view(batch, num_kv_heads, group, q_len)
    q5 = q.view(batch, num_kv_heads, group, q_len, head_dim).to(work)
    depth_logits = torch.einsum("bhgtd,bhtmd->bhgtm", q5, depth_k.to(work)) * scale  # (B, Hkv, G, T, M)
    lse = torch.logaddexp(lse_seq, torch.logsumexp(depth_logits, dim=-1))  # (B, Hkv, G, T)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # no visible entry: zeros, not NaN
    alpha = torch.exp(lse_seq - lse)  # (B, Hkv, G, T)
    probs = torch.exp(depth_logits - lse.unsqueeze(-1))  # (B, Hkv, G, T, M)
    out = alpha.unsqueeze(-1) * out_seq.view(batch, num_kv_heads, group, q_len, head_dim).to(work)
    out = out + torch.einsum("bhgtm,bhtmd->bhgtd", probs, depth_v.to(work))
    return out.reshape(batch, num_q_heads, q_len, head_dim).to(q.dtype), (lse_kernel, alpha, probs)


def _flash_cpu_backward(grad_out, q, k, v, depth_k, depth_v, out, state, mask, is_causal, scale, needs):
    """The fused CPU backward without autograd: the five gradients, None where ``needs`` is False.

    See ``_MoDAFlashCPU`` for the derivation; ``state`` is the second value of :func:`_flash_cpu_forward`.
    """
    lse_kernel, alpha, probs = state
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    work = alpha.dtype
    shape5 = (batch, num_kv_heads, group, q_len, head_dim)
    grad5 = grad_out.to(work).reshape(shape5)  # (B, Hkv, G, T, d)
    grad_q = grad_k = grad_v = grad_depth_k = grad_depth_v = None
    if needs[0] or needs[1] or needs[2]:
        grad_seq = (alpha.unsqueeze(-1) * grad5).view(batch, num_q_heads, q_len, head_dim).to(q.dtype)
        grad_q, grad_k, grad_v = _FLASH_CPU_BACKWARD(
            grad_seq, q, k, v, out, lse_kernel, 0.0, is_causal, attn_mask=mask, scale=scale
        )
    if probs.shape[-1] > 0 and (needs[0] or needs[3]):
        delta = (grad5 * out.to(work).view(shape5)).sum(dim=-1)  # D = rowsum(dO * out), (B, Hkv, G, T)
        grad_probs = torch.einsum("bhgtd,bhtmd->bhgtm", grad5, depth_v.to(work))  # (B, Hkv, G, T, M)
        # dS = P (dP - D), times the logit scale here on the small [.., M] tensor, not on [.., M, d].
        grad_logits = probs * (grad_probs - delta.unsqueeze(-1)) * scale
        if needs[0]:
            grad_q_depth = torch.einsum("bhgtm,bhtmd->bhgtd", grad_logits, depth_k.to(work))
            grad_q = (grad_q.to(work).reshape(shape5) + grad_q_depth).reshape(q.shape).to(q.dtype)
        if needs[3]:
            q5 = q.view(shape5).to(work)
            grad_depth_k = torch.einsum("bhgtm,bhgtd->bhtmd", grad_logits, q5).to(depth_k.dtype)
    elif needs[3]:
        grad_depth_k = torch.zeros(depth_k.shape, dtype=depth_k.dtype)
    if needs[4]:
        grad_depth_v = torch.einsum("bhgtm,bhgtd->bhtmd", probs, grad5).to(depth_v.dtype)
    grads = (grad_q, grad_k, grad_v, grad_depth_k, grad_depth_v)
    return tuple(g if need else None for g, need in zip(grads, needs))


def _second_order_grads(inputs, needs, grad_out, attention_mask, scale, causal):
    """Gradients of :func:`moda_torch_math` recomputed with ``create_graph=True`` (a custom Function's
    backward run under ``create_graph``): correct, twice differentiable, and materialised [T, S].

    Recomputed from aliases (views) of the inputs that only it reads: with respect to the inputs themselves the
    gradient would be the total derivative through the caller's graph, where one input may depend on another (keys
    computed from the queries, depth entries from the keys); the result stays connected to the inputs."""
    inputs = [x.view_as(x) for x in inputs]
    out = moda_torch_math(*inputs, attention_mask, scale, causal)
    wanted = [x for x, need in zip(inputs, needs) if need]
    grads = iter(torch.autograd.grad(out, wanted, grad_out, create_graph=True, allow_unused=True))
    result = [next(grads) if need else None for need in needs]
    return tuple(torch.zeros_like(x) if need and g is None else g for x, need, g in zip(inputs, needs, result))


class _MoDAFlashCPU(torch.autograd.Function):
    """MoDA as SDPA's fused CPU flash attention over the sequence pool plus the depth pool, merged exactly.

    With ``o_s``, ``lse_s`` the sequence pool's normalised output and row log-sum-exp (from the kernel)
    and ``l_m = scale q . depth_k_m`` the depth logits, the joint softmax is

        lse = logaddexp(lse_s, logsumexp_m l_m),  alpha = exp(lse_s - lse),  p_m = exp(l_m - lse)
        out = alpha o_s + sum_m p_m depth_v_m.

    Backward (FlashAttention style, nothing [T, S] saved): with ``D = rowsum(dO * out)`` every
    joint logit gets ``dS = P (dP - D)``. The sequence part is the kernel's own backward called with
    ``grad_out = alpha dO`` and ``out = out`` (the *joint* output): the kernel recomputes
    ``P_s = exp(S - lse_s)`` and forms ``P_s (alpha dO . v - rowsum(alpha dO * out)) = alpha P_s (dP - D)``,
    which is exactly the joint ``dS`` on the sequence keys since ``P = alpha P_s``; its dV is
    ``P_s^T alpha dO = P^T dO``. The depth part is a few small batched products. Saved: the inputs,
    the output, the kernel's log-sum-exp [B, Hq, T], ``alpha`` [B, Hq, T] and ``p`` [B, Hq, T, M].

    Second-order gradients (a backward under ``create_graph=True``) are computed by recomputing the
    materialised :func:`moda_torch_math` on the saved inputs and differentiating it.
    """

    @staticmethod
    def forward(ctx, q, k, v, depth_k, depth_v, mask, is_causal, empty_rows, scale, attention_mask, causal):  # noqa: D102
        out, state = _flash_cpu_forward(q, k, v, depth_k, depth_v, mask, is_causal, empty_rows, scale)
        ctx.save_for_backward(q, k, v, depth_k, depth_v, out, *state)
        ctx.mask, ctx.is_causal, ctx.scale = mask, is_causal, scale
        ctx.attention_mask, ctx.causal = attention_mask, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, depth_k, depth_v, out, *state = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:5])
        if torch.is_grad_enabled():  # create_graph=True
            grads = _second_order_grads((q, k, v, depth_k, depth_v), needs, grad_out, ctx.attention_mask,
                                        ctx.scale, ctx.causal)
        else:
            grads = _flash_cpu_backward(grad_out, q, k, v, depth_k, depth_v, out, state, ctx.mask,
                                        ctx.is_causal, ctx.scale, needs)
        return (*grads, None, None, None, None, None, None)


def moda_torch_flash_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """MoDA on CPU through SDPA's fused flash kernel for the sequence pool (no [T, S] matrix kept).

    Exact: the sequence pool's output and log-sum-exp are merged with the depth pool in one softmax
    (see ``_MoDAFlashCPU``). Differentiable in q, k, v, depth_k, depth_v (not in the mask), twice
    through a materialised recompute. Any strides (q, k, v whose last dim is not unit-stride are
    copied for the kernel).

    Args:
        q: [B, Hq, T, d] on CPU, T >= 1; k, v: [B, Hkv, S, d]; depth_k, depth_v: [B, Hkv, T, M, d].
        attention_mask: None, bool (True = attend) or additive float, broadcastable to [B, Hq, T, S].
    Returns:
        [B, Hq, T, d] in q's dtype.
    """
    mask, is_causal, empty_rows = _sequence_mask(attention_mask, causal, q.shape[2], k.shape[2], q.dtype)
    q, k, v = _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v)
    return _MoDAFlashCPU.apply(q, k, v, depth_k, depth_v, mask, is_causal, empty_rows, scale, attention_mask, causal)


def _dispatch_mode_active() -> bool:
    """True under a Python dispatch mode (``FlopCounterMode``, fake tensors, ...)."""
    try:
        return torch._C._len_torch_dispatch_stack() > 0
    except AttributeError:  # pragma: no cover - older torch
        return False


def _mask_needs_grad(attention_mask: torch.Tensor | None) -> bool:
    return attention_mask is not None and attention_mask.requires_grad and torch.is_grad_enabled()


def _flash_cpu_applies(q: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """The fused CPU path serves CPU tensors of the kernel's dtypes, with a mask that needs no gradient.

    Under a Python dispatch mode the materialised path runs instead: tools such as ``FlopCounterMode``
    have no formula for the CPU flash op and would miss the attention FLOPs.
    """
    return (
        _FLASH_CPU is not None
        and _FLASH_CPU_BACKWARD is not None
        and q.device.type == "cpu"
        and q.dtype in _FLASH_CPU_DTYPES
        and q.shape[2] > 0
        and not _mask_needs_grad(attention_mask)
        and not _dispatch_mode_active()
    )


def _triton_applies(q: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """The Triton kernels serve their dtypes (not float64) with a mask that needs no gradient."""
    return q.dtype in TRITON_MODA_DTYPES and not _mask_needs_grad(attention_mask)


def moda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """The PyTorch backend: :func:`moda_torch_flash_cpu` on CPU, else :func:`moda_torch_math`.

    Args:
        q: [B, Hq, T, d]; k, v: [B, Hkv, S, d]; depth_k, depth_v: [B, Hkv, T, M, d].
    Returns:
        [B, Hq, T, d] in q's dtype.
    """
    if _flash_cpu_applies(q, attention_mask):
        return moda_torch_flash_cpu(q, k, v, depth_k, depth_v, attention_mask, scale, causal)
    return moda_torch_math(q, k, v, depth_k, depth_v, attention_mask, scale, causal)


def moda_attention_with_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    backend: str,
) -> torch.Tensor:
    """The unvalidated core of :func:`moda_attention` for callers that validated and resolved once.

    Args:
        q: [B, Hq, T, d]; k, v: [B, Hkv, S, d]; depth_k, depth_v: [B, Hkv, T, M, d] (any strides).
        attention_mask: None, bool (True = attend) or additive float, broadcastable to [B, Hq, T, S].
        scale: the logit scale (a float, no default here); causal: as in :func:`moda_attention`.
        backend: a resolved backend, ``"reference"``, ``"torch"`` or ``"triton"`` (from :func:`resolve_backend`).
            Calls the Triton kernels cannot compute (float64, a mask that needs a gradient) run the
            PyTorch path instead.
    Returns:
        [B, Hq, T, d] in q's dtype.
    """
    if backend == "reference":
        return moda_reference(q, k, v, depth_k, depth_v, attention_mask, scale, causal)
    if backend == "triton" and _triton_applies(q, attention_mask):
        return triton_moda_attention(q, k, v, depth_k, depth_v, attention_mask, scale, causal,
                                     second_order=moda_torch_math)
    return moda_torch(q, k, v, depth_k, depth_v, attention_mask, scale, causal)


@dataclass
class MoDASaved:
    """What :func:`moda_backward_from` needs from :func:`moda_forward_saving` (opaque to callers).

    ``path`` is ``"flash_cpu"`` or ``"triton"``; ``inputs`` are q, k, v, depth_k, depth_v as the
    kernel read them (views are kept, not copied: do not write into them before the backward);
    ``out`` [B, Hq, T, d]; ``state`` the path's saved statistics.
    """

    path: str
    inputs: tuple[torch.Tensor, ...]
    out: torch.Tensor
    state: tuple
    mask: torch.Tensor | None
    is_causal: bool
    scale: float
    causal: bool


def moda_saving_supported(q: torch.Tensor, attention_mask: torch.Tensor | None, backend: str) -> bool:
    """True when :func:`moda_forward_saving` can serve this call (else use :func:`moda_attention_with_backend`).

    Supported: ``backend="torch"`` on CPU (the fused flash path: fp32, fp64, bf16, fp16) and
    ``backend="triton"`` (fp32, bf16, fp16 on the kernels' device), with T >= 1 and a mask that needs
    no gradient; not ``"reference"``, not the PyTorch path on other devices, not under a Python
    dispatch mode (FLOP counters, fake tensors).
    """
    if q.shape[2] == 0 or _mask_needs_grad(attention_mask):
        return False
    if backend == "torch":
        return _flash_cpu_applies(q, attention_mask)
    if backend == "triton":
        return moda_triton_runs_on(q.device) and _triton_applies(q, attention_mask) and not _dispatch_mode_active()
    return False


def moda_forward_saving(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    backend: str,
) -> tuple[torch.Tensor, MoDASaved]:
    """MoDA forward without an autograd graph, keeping what :func:`moda_backward_from` needs.

    For callers that own the backward of a whole pass (the model's depth stream). Inputs are not
    validated (as for :func:`moda_attention_with_backend`); ``depth_k`` / ``depth_v`` may be any
    strided views [B, Hkv, T, M, d], e.g. ``buffer[lo:hi].permute(1, 3, 2, 0, 4)`` of a slot-major buffer
    [M_max, B, T, Hkv, d] (the model's depth stream), M may be 0.

    Args:
        q: [B, Hq, T, d]; k, v: [B, Hkv, S, d]; depth_k, depth_v: [B, Hkv, T, M, d].
        attention_mask: None, bool (True = attend) or additive float (no gradient), broadcastable to [B, Hq, T, S].
        scale: the logit scale; causal: as in :func:`moda_attention`.
        backend: ``"torch"`` (CPU flash path) or ``"triton"``; see :func:`moda_saving_supported`.
    Returns:
        ``(out, saved)``: out [B, Hq, T, d] in q's dtype (no grad_fn), saved a :class:`MoDASaved`.
    Raises:
        ValueError: when the call is not supported (backend, device, dtype, T = 0, a mask that needs a
            gradient, a dispatch mode); the message names the problem. Use :func:`moda_attention_with_backend`.
    """
    if not moda_saving_supported(q, attention_mask, backend):
        raise ValueError(
            "moda_forward_saving supports backend='torch' on CPU (fp32/fp64/bf16/fp16) and backend='triton' "
            f"(fp32/bf16/fp16), T >= 1, a mask without gradient, no dispatch mode; got backend={backend!r}, "
            f"device={q.device.type}, dtype={q.dtype}, T={q.shape[2]}, "
            f"mask requires grad={_mask_needs_grad(attention_mask)}; use moda_attention_with_backend instead"
        )
    scale, causal = float(scale), bool(causal)
    with torch.no_grad():
        if backend == "triton":
            out, state = triton_moda_forward(q, k, v, depth_k, depth_v, attention_mask, scale, causal)
            return out, MoDASaved("triton", (q, k, v, depth_k, depth_v), out, state, None, causal, scale, causal)
        mask, is_causal, empty_rows = _sequence_mask(attention_mask, causal, q.shape[2], k.shape[2], q.dtype)
        q, k, v = _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v)
        out, state = _flash_cpu_forward(q, k, v, depth_k, depth_v, mask, is_causal, empty_rows, scale)
    return out, MoDASaved("flash_cpu", (q, k, v, depth_k, depth_v), out, state, mask, is_causal, scale, causal)


def moda_backward_from(
    saved: MoDASaved,
    grad_out: torch.Tensor,
    needs: tuple[bool, bool, bool, bool, bool] = (True,) * 5,
    depth_grads_into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The backward of :func:`moda_forward_saving`: ``(dq, dk, dv, d_depth_k, d_depth_v)``.

    Args:
        saved: from :func:`moda_forward_saving`.
        grad_out: [B, Hq, T, d], the gradient of the output (any strides).
        needs: which of the five gradients to return (None for the others; skipping dk and dv skips
            their work).
        depth_grads_into: None, or ``(gk, gv)``: floating tensors of depth_k's shape [B, Hkv, T, M, d] on
            its device, any strides (e.g. ``grad_buffer[:, :, :, lo:hi]``), any floating dtype (an fp32
            buffer for bf16 entries is fine). The depth gradients are then ADDED into them in place
            (Triton: inside the kernel) and returned as those tensors, whatever ``needs[3:]`` says.
    Returns:
        Gradients with their inputs' shapes (the depth gradients have the view's shape
        [B, Hkv, T, M, d]), in the inputs' dtypes. Computed without an autograd graph (first order only).
    Raises:
        ValueError: when ``depth_grads_into`` does not have depth_k's shape and device.
    """
    needs = tuple(bool(n) for n in needs)
    if depth_grads_into is not None:
        depth_k = saved.inputs[3]
        for name, into in zip(("gk", "gv"), depth_grads_into):
            fits = tuple(into.shape) == tuple(depth_k.shape) and into.device == depth_k.device
            if not (fits and into.is_floating_point()):
                raise ValueError(
                    f"depth_grads_into {name} must be a floating tensor of depth_k's shape {tuple(depth_k.shape)} "
                    f"on {depth_k.device}; got {into.dtype} {tuple(into.shape)} on {into.device}"
                )
        needs = needs[:3] + (True, True)
    with torch.no_grad():
        if saved.path == "triton":
            grads = triton_moda_backward(grad_out, *saved.inputs, saved.out, saved.state, saved.scale, saved.causal,
                                         sequence_kv=needs[1] or needs[2], depth_grads_into=depth_grads_into)
            return tuple(g if need else None for g, need in zip(grads, needs))
        grads = _flash_cpu_backward(grad_out, *saved.inputs, saved.out, saved.state, saved.mask, saved.is_causal,
                                    saved.scale, needs)
        if depth_grads_into is None:
            return grads
        depth_grads_into[0].add_(grads[3])
        depth_grads_into[1].add_(grads[4])
        return (*grads[:3], *depth_grads_into)


def moda_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Mixture-of-depths attention: one softmax over the causal sequence keys and the token's own depth keys.

    Args:
        q: [B, Hq, T, d] queries; they sit at the last T of the S sequence positions (prefill: S = T;
            cached decoding: S = past + T).
        k, v: [B, Hkv, S, d] sequence keys/values; query head ``h`` uses KV head ``h // (Hq / Hkv)``.
        depth_k, depth_v: [B, Hkv, T, M, d] the M depth entries of each query token (M may be 0), read
            with the same GQA mapping.
        attention_mask: None, bool (True = attend) or additive float, broadcastable to [B, Hq, T, S].
            It applies to the sequence pool only; depth entries are always visible to their token.
            A float mask that requires grad gets its gradient (on every backend).
        scale: logit scale for both pools; default ``1 / sqrt(d)``.
        causal: hide sequence keys after the query's position ``S - T + t``.
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` or None (then
            ``$DEPTHFUSION_BACKEND``, default ``"auto"``).
    Returns:
        [B, Hq, T, d] in q's dtype, differentiable twice. A row with no visible entry at all (every
        sequence key masked with False/-inf and M = 0) returns zeros rather than NaN.
    Raises:
        ValueError: when a shape, dtype or device does not fit (the message names the argument and the
            expected shape), or the backend is unknown.
    """
    check_moda_inputs(q, k, v, depth_k, depth_v, attention_mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    backend = resolve_backend(backend, q.device)
    return moda_attention_with_backend(q, k, v, depth_k, depth_v, attention_mask, scale, causal, backend)


__all__ = [
    "MoDASaved",
    "moda_attention",
    "moda_attention_with_backend",
    "moda_backward_from",
    "moda_forward_saving",
    "moda_joint_probs",
    "moda_reference",
    "moda_saving_supported",
    "moda_torch",
    "moda_torch_flash_cpu",
    "moda_torch_math",
    "resolve_backend",
]
