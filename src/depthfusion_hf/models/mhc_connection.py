"""The hyper-connection of mHC (manifold-constrained Hyper-Connections; ``../shared/PAPERS.md`` §5, transformers'
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``): from a token's streams ``X`` [n, D], the weights of one
sub-layer and its input. ``fn`` [(2 + n) n, n D] (rows ``[pre | post | comb]``), ``base`` [(2 + n) n], ``scale`` [3]:

    m = fn . RMSNorm_unweighted(flatten(X)); pre = sigmoid(scale[0] m_pre + base_pre) + eps;
    post = 2 sigmoid(scale[1] m_post + base_post); comb = Sinkhorn(softmax_row(scale[2] m_comb + base_comb) + eps);
    collapsed = sum_j pre_j X_j

The head is the ``pre`` part alone (``fn`` [n, n D], ``base`` [n], ``scale`` [1]). The mixing step after the
sub-layer is ``mhc_mix.py``'s op.

=================  ==========================================================================================
backend            implementation
=================  ==========================================================================================
``"reference"``    :func:`hyper_connection_reference` / :func:`hyper_head_reference`: the formulas as
                   transformers writes them; autograd (every order). The oracle.
``"torch"``        :func:`hyper_connection_torch` / :func:`hyper_head_torch`: the custom autograd Function
                   :class:`_HyperConnection` (backward in torch ops: every order) when a gradient is wanted, the
                   same operations without it (:func:`_values`) otherwise. The norm is applied after the
                   projection and the Sinkhorn loop runs on two scaling vectors (:func:`sinkhorn_scalings`).
``"triton"``       ``mhc_triton.triton_hyper_connection``: fused kernels for CUDA tensors (CPU tensors under
                   ``TRITON_INTERPRET=1``). First order only (``create_graph=True`` raises a RuntimeError).
                   Routed to ``"torch"``: float64 work, more than ``TRITON_MAX_STREAMS`` streams, empty inputs.
=================  ==========================================================================================

Which one runs: :func:`resolve_backend`. Dtypes, for every backend: the weights are computed and returned in
float32 (float64 when an input is float64), the paper's fp32; ``collapsed`` is accumulated in that dtype and
rounded once to the streams' dtype. Autocast is disabled inside (the projection is part of the fp32 weight
computation; an fp32 model's streams stay fp32 under autocast, as a Llama's residual does).

Self-contained (``torch`` and same-folder imports only): ``save_pretrained`` copies it next to the model code.
"""


import torch
import torch.nn.functional as F

from .depthfusion_common import BACKEND_ENV_VAR, BACKENDS  # noqa: F401 - part of the op's API
from .depthfusion_common import resolve_backend as resolve_op_backend
from .mhc_inputs import autocast_off, cast, check_positive, check_streams, check_tensor, weight_dtype

try:  # Triton is optional: the model loads and runs without it.
    from .mhc_triton import (
        MHC_TRITON_DTYPES,
        TRITON_MAX_STREAMS,
        triton_hyper_connection,
    )
except Exception:  # pragma: no cover - depends on the environment
    MHC_TRITON_DTYPES = ()
    TRITON_MAX_STREAMS = 0
    triton_hyper_connection = None




def resolve_backend(backend: str | None, device: torch.device, config_backend: str | None = None) -> str:
    """The mHC backend: ``"reference"``, ``"torch"`` or ``"triton"``, chosen by the one rule of
    :func:`depthfusion_common.resolve_backend` (the ``backend`` argument, ``$DEPTHFUSION_BACKEND``, the config's
    ``op_backend``, automatic); a ValueError for an unknown name or a Triton backend that cannot run."""
    return resolve_op_backend(backend, device, config_backend, kernels_imported=triton_hyper_connection is not None,
                              op=__name__)


def check_hyper_connection_inputs(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, head: bool) -> None:
    """Raise a ValueError naming the argument unless every backend computes these inputs correctly.

    Attribute reads only (no host synchronisation): a model calls the op twice per layer.
    """
    _, _, n, dim = check_streams(streams)
    rows = n if head else (2 + n) * n
    layout = "[n]" if head else "[(2 + n) n]"
    check_tensor("fn", fn, (rows, n * dim), streams.device, layout[:-1] + ", n D]")
    check_tensor("base", base, (rows,), streams.device, layout)
    check_tensor("scale", scale, (1,) if head else (3,), streams.device, "[1]" if head else "[3]")
    if not head and (isinstance(sinkhorn_iters, bool) or not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1):
        raise ValueError(f"sinkhorn_iters must be an integer >= 1; got {sinkhorn_iters!r}")
    check_positive("eps", eps)
    check_positive("norm_eps", norm_eps)


def triton_computes(streams: torch.Tensor, work_dtype: torch.dtype, io_dtype: torch.dtype) -> bool:
    """True when the Triton kernels compute an op on ``streams``: fp32 arithmetic (``work_dtype``), a result dtype
    they write (``io_dtype``), a non-empty input and few enough streams (both ops' routing)."""
    return (work_dtype == torch.float32 and io_dtype in MHC_TRITON_DTYPES and streams.numel() > 0
            and streams.shape[2] <= TRITON_MAX_STREAMS)


# ---------------------------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------------------------


def hyper_connection_weights_reference(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    sinkhorn_iters: int, eps: float, norm_eps: float, head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(pre, post, comb)`` as transformers' ``DeepseekV4HyperConnection`` (``head``: ``DeepseekV4HyperHead``,
    ``post`` and ``comb`` None) computes them, in :func:`weight_dtype`.

    Args:
        streams: [B, T, n, D]. fn: [(2 + n) n, n D] ([n, n D] for the head). base: [(2 + n) n] ([n]).
        scale: [3] ([1]). sinkhorn_iters: >= 1. eps: hc_eps. norm_eps: the streams' RMSNorm epsilon.
    Returns:
        pre [B, T, n], post [B, T, n], comb [B, T, n, n] (rows: the stream read, columns: the stream written).
    """
    n = streams.shape[-2]
    dtype = weight_dtype(streams, fn, base, scale)
    flat = streams.flatten(-2).to(dtype)  # (B, T, nD)
    x = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(x, fn.to(dtype))  # (B, T, (2 + n) n)
    base, scale = base.to(dtype), scale.to(dtype)
    if head:
        return torch.sigmoid(mixes * scale[0] + base) + eps, None, None
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def collapse_reference(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre_j X_j`` over the streams, accumulated in pre's dtype and rounded once: [B, T, D]."""
    out = pre[..., 0, None] * streams[..., 0, :].to(pre.dtype)
    for j in range(1, streams.shape[-2]):
        out = out + pre[..., j, None] * streams[..., j, :].to(pre.dtype)
    return out.to(streams.dtype)


def hyper_connection_reference(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps):
    """The reference backend of :func:`hyper_connection`: ``(post, comb, collapsed)``."""
    pre, post, comb = hyper_connection_weights_reference(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps)
    return post, comb, collapse_reference(streams, pre)


def hyper_head_reference(streams, fn, base, scale, eps, norm_eps):
    """The reference backend of :func:`hyper_head`: ``collapsed`` [B, T, D]."""
    pre, _, _ = hyper_connection_weights_reference(streams, fn, base, scale, 1, eps, norm_eps, head=True)
    return collapse_reference(streams, pre)


# ---------------------------------------------------------------------------------------------------------------
# vectorised PyTorch
# ---------------------------------------------------------------------------------------------------------------


def sinkhorn_scalings(matrix: torch.Tensor, iters: int, eps: float,
                      keep: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The Sinkhorn loop of :func:`hyper_connection_weights_reference` on positive matrices ``A`` [N, n, n], kept as
    scaling vectors: the result is ``A * r s^T``.

    A column step ``M / (column sums + eps)`` of ``M = A * r s^T`` is ``v <- A^T r + eps v``, ``s = 1 / v``; a row
    step is ``u <- A s + eps u``, ``r = 1 / u`` (``u = 1``, ``v`` = the column sums + eps after the first step):
    the loop's function on n-vectors, one ``baddbmm`` and one reciprocal per half-step.

    Returns:
        ``(rows, cols)``: ``rows`` = [r_1 .. r_{iters-1}], ``cols`` = [s_0 .. s_{iters-1}], each [N, n, 1]; with
        ``keep=False`` only the last of each (what the result needs; the backward needs them all).
    """
    transposed = matrix.transpose(1, 2)
    v = matrix.sum(1).unsqueeze(-1) + eps  # (N, n, 1)
    s = v.reciprocal()
    rows, cols = [], [s]
    u = None
    for step in range(iters - 1):
        if keep or step == 0:
            u = torch.bmm(matrix, s).add_(eps) if u is None else torch.baddbmm(u, matrix, s, beta=eps)
            r = u.reciprocal()
            v = torch.baddbmm(v, transposed, r, beta=eps)
            s = v.reciprocal()
            rows.append(r)
            cols.append(s)
            continue
        if step == 1:  # without the history: the same kernels writing into buffers (no allocation per half-step)
            u_spare, v_spare = torch.empty_like(u), torch.empty_like(v)
        u, u_spare = torch.baddbmm(u, matrix, s, beta=eps, out=u_spare), u
        torch.reciprocal(u, out=r)
        v, v_spare = torch.baddbmm(v, transposed, r, beta=eps, out=v_spare), v
        torch.reciprocal(v, out=s)
    return (rows, cols) if keep else (rows[-1:], cols[-1:])


def sinkhorn_vjp(grad: torch.Tensor, matrix: torch.Tensor, comb: torch.Tensor, rows: list[torch.Tensor],
                 cols: list[torch.Tensor], eps: float) -> torch.Tensor:
    """d loss / d A for ``comb = A * r s^T`` (:func:`sinkhorn_scalings`), given d loss / d comb = ``grad``, [N, n, n]:
    the scaling-vector recursion run backwards (differentiable torch ops). Each half-step adds an outer product
    to d A; they are collected and summed by one batched product at the end."""
    r, s = (rows[-1] if rows else None), cols[-1]
    weighted = grad * comb
    d_matrix = grad * (s.transpose(1, 2) if r is None else r * s.transpose(1, 2))
    d_v = -weighted.sum(1).unsqueeze(-1) * s
    d_u = -weighted.sum(2, keepdim=True) * r if r is not None else None
    transposed = matrix.transpose(1, 2)
    lefts, rights = [], []  # d A += lefts[i] rights[i]^T
    for k in range(len(rows) - 1, -1, -1):
        r, s = rows[k], cols[k]  # r_{k+1}, s_k
        # v_{k+1} = A^T r_{k+1} + eps v_k
        lefts.append(r)
        rights.append(d_v)
        d_u = torch.addcmul(d_u, torch.bmm(matrix, d_v), r * r, value=-1)
        d_v = eps * d_v
        # u_{k+1} = A s_k + eps u_k
        lefts.append(d_u)
        rights.append(s)
        d_v = torch.addcmul(d_v, torch.bmm(transposed, d_u), s * s, value=-1)
        d_u = eps * d_u
    d_matrix = d_matrix + d_v.transpose(1, 2)  # v_0 = the column sums of A + eps
    if lefts:
        d_matrix = torch.baddbmm(d_matrix, torch.cat(lefts, dim=2), torch.cat(rights, dim=2).transpose(1, 2))
    return d_matrix


def _project(streams: torch.Tensor, fn: torch.Tensor, dtype: torch.dtype, norm_eps: float):
    """``(x [N, nD], rstd [N, 1], m [N, rows])`` with ``m = rstd * (x fn^T) = fn . RMSNorm(x)`` (no normalised copy)."""
    x = cast(streams.reshape(-1, streams.shape[-2] * streams.shape[-1]), dtype)  # a view for contiguous streams
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    return x, rstd, torch.mm(x, cast(fn, dtype).t()) * rstd


def _weights(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float, head: bool,
             keep: bool = True):
    """``(gates, A, rows, cols)`` from the projections m [N, rows]: gates = the sigmoids of pre (and post) [N, 1 or 2,
    n]; A = softmax + eps [N, n, n] and its Sinkhorn scalings (``None, [], []`` for the head)."""
    if head:
        return torch.sigmoid(torch.addcmul(base, m, scale)).unsqueeze(1), None, [], []
    gates = torch.sigmoid(torch.addcmul(base[: 2 * n].view(2, n), m[:, : 2 * n].view(-1, 2, n), scale[:2, None]))
    logits = torch.addcmul(base[2 * n:].view(n, n), m[:, 2 * n:].view(-1, n, n), scale[2])
    matrix = torch.softmax(logits, dim=-1) + eps
    return gates, matrix, *sinkhorn_scalings(matrix, iters, eps, keep)


def _comb(matrix: torch.Tensor, rows: list[torch.Tensor], cols: list[torch.Tensor]) -> torch.Tensor:
    """``A * r s^T``, the Sinkhorn result."""
    return matrix * cols[-1].transpose(1, 2) if not rows else matrix * (rows[-1] * cols[-1].transpose(1, 2))


def _outputs(streams: torch.Tensor, x: torch.Tensor, gates: torch.Tensor, comb: torch.Tensor | None, eps: float):
    """``collapsed = pre . X`` (a [1, n] x [n, D] product per token); with ``comb``: ``(post, comb, collapsed)``."""
    batch, tokens, n, dim = streams.shape
    pre = gates[:, 0] + eps  # (N, n)
    collapsed = cast(torch.bmm(pre.unsqueeze(1), x.view(-1, n, dim)).view(batch, tokens, dim), streams.dtype)
    if comb is None:
        return collapsed
    return (2 * gates[:, 1]).view(batch, tokens, n), comb.view(batch, tokens, n, n), collapsed


def _values(streams, fn, base, scale, iters: int, eps: float, norm_eps: float, head: bool):
    """The torch backend's forward without autograd (no gradient wanted: decoding, evaluation): the same operations
    as :class:`_HyperConnection`'s forward (the same numbers, bit for bit: a reentrant checkpoint's no-grad forward
    and its recomputation agree), without the Function's bookkeeping, the Sinkhorn loop keeping only its last
    scalings."""
    dtype = weight_dtype(streams, fn, base, scale)
    x, _, m = _project(streams, fn, dtype, norm_eps)
    gates, matrix, rows, cols = _weights(m, cast(base, dtype), cast(scale, dtype), streams.shape[-2], iters, eps,
                                         head, keep=False)
    return _outputs(streams, x, gates, None if head else _comb(matrix, rows, cols), eps)


class _HyperConnection(torch.autograd.Function):
    """The torch backend of :func:`hyper_connection` (and of :func:`hyper_head`, ``head=True``) when a gradient is
    wanted (:func:`_values` otherwise).

    Forward as :func:`_project` / :func:`_weights` / :func:`_outputs`. It saves the inputs and the small per-token
    pieces (m, rstd, the gates, A and the Sinkhorn scaling vectors). The backward is the chain rule written out in
    torch ops: the Sinkhorn recursion backwards (:func:`sinkhorn_vjp`), the softmax and sigmoids, then the
    projection with its norm, ``dX = dp fn - c x + pre ⊗ g`` in one product and two multiply-adds in place, and
    ``dfn = dp^T x``. Under ``create_graph=True`` the pieces are recomputed from the saved inputs with autograd
    recording, so every order of derivative is exact.
    """

    @staticmethod
    def forward(ctx, streams, fn, base, scale, iters: int, eps: float, norm_eps: float, head: bool):
        dtype = weight_dtype(streams, fn, base, scale)
        x, rstd, m = _project(streams, fn, dtype, norm_eps)
        gates, matrix, rows, cols = _weights(m, cast(base, dtype), cast(scale, dtype), streams.shape[-2], iters, eps,
                                             head)
        ctx.settings = (iters, eps, norm_eps, head, len(rows))
        ctx.save_for_backward(streams, fn, base, scale, m, rstd, gates, *([] if head else [matrix, *rows, *cols]))
        return _outputs(streams, x, gates, None if head else _comb(matrix, rows, cols), eps)

    @staticmethod
    def backward(ctx, *grads):
        iters, eps, norm_eps, head, num_rows = ctx.settings
        streams, fn, base, scale, m, rstd, gates, *sinkhorn = ctx.saved_tensors
        dtype = weight_dtype(streams, fn, base, scale)
        batch, tokens, n, dim = streams.shape
        base_w, scale_w, fn_w = cast(base, dtype), cast(scale, dtype), cast(fn, dtype)
        if torch.is_grad_enabled():  # create_graph: recompute from the inputs so that the graph reaches them
            x, rstd, m = _project(streams, fn, dtype, norm_eps)
            gates, matrix, rows, cols = _weights(m, base_w, scale_w, n, iters, eps, head)
        else:
            x = cast(streams.reshape(-1, n * dim), dtype)
            if not head:
                matrix, rows, cols = sinkhorn[0], sinkhorn[1:1 + num_rows], sinkhorn[1 + num_rows:]
        g_collapsed = cast(grads[-1].reshape(-1, dim), dtype)  # (N, D)
        sig_pre = gates[:, 0]
        d_pre = (x.view(-1, n, dim) * g_collapsed.unsqueeze(1)).sum(-1)  # (N, n); bmm is slow at [n, D] x [D, 1]
        d_z = d_pre * sig_pre * (1 - sig_pre)  # through pre = sigmoid(z_pre) + eps
        if not head:
            g_post = cast(grads[0].reshape(-1, n), dtype)
            sig_post = gates[:, 1]
            d_z_post = 2 * g_post * sig_post * (1 - sig_post)
            d_matrix = sinkhorn_vjp(cast(grads[1].reshape(-1, n, n), dtype), matrix, _comb(matrix, rows, cols), rows,
                                    cols, eps)
            soft = matrix - eps  # the softmax
            d_z_comb = soft * (d_matrix - (d_matrix * soft).sum(-1, keepdim=True))
            d_z = torch.cat([d_z, d_z_post, d_z_comb.flatten(1)], dim=1)  # (N, (2 + n) n), laid out as fn's rows
        groups = [n] if head else [n, n, n * n]
        d_scale = torch.stack([part.sum() for part in (d_z * m).split(groups, dim=1)])
        d_m = d_z * torch.cat([scale_w[i].expand(size) for i, size in enumerate(groups)])
        d_p = d_m * rstd  # gradient of p = x fn^T
        d_streams = d_fn = None
        if ctx.needs_input_grad[0]:
            # x -> m = rstd * p: dx = dp fn - (sum_r dm_r m_r) rstd^2 x / (nD); plus the collapse's pre ⊗ g
            coefficient = (d_m * m).sum(-1, keepdim=True) * rstd.square() * (-1.0 / (n * dim))
            d_x = torch.mm(d_p, fn_w).addcmul_(x, coefficient).view(-1, n, dim)  # (N, n, D)
            d_x = d_x.addcmul_((sig_pre + eps).unsqueeze(-1), g_collapsed.unsqueeze(1))  # the collapse's pre ⊗ g
            d_streams = cast(d_x.view(batch, tokens, n, dim), streams.dtype)
        if ctx.needs_input_grad[1]:
            d_fn = cast(torch.mm(d_p.t(), x), fn.dtype)
        return d_streams, d_fn, cast(d_z.sum(0), base.dtype), cast(d_scale, scale.dtype), None, None, None, None


def _torch_connection(streams, fn, base, scale, iters: int, eps: float, norm_eps: float, head: bool):
    """:class:`_HyperConnection` when autograd records and an input wants a gradient, else :func:`_values`."""
    if torch.is_grad_enabled() and (streams.requires_grad or fn.requires_grad or base.requires_grad
                                    or scale.requires_grad):
        return _HyperConnection.apply(streams, fn, base, scale, iters, eps, norm_eps, head)
    return _values(streams, fn, base, scale, iters, eps, norm_eps, head)


def hyper_connection_torch(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps):
    """The vectorised PyTorch backend of :func:`hyper_connection` (:func:`_torch_connection`)."""
    return _torch_connection(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, False)


def hyper_head_torch(streams, fn, base, scale, eps, norm_eps):
    """The vectorised PyTorch backend of :func:`hyper_head` (:func:`_torch_connection` with ``head=True``)."""
    return _torch_connection(streams, fn, base, scale, 1, eps, norm_eps, True)


# ---------------------------------------------------------------------------------------------------------------
# the entry points
# ---------------------------------------------------------------------------------------------------------------


def hyper_connection(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    eps: float,
    norm_eps: float,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weights of one mHC sub-layer and its input, from the streams (see the module docstring).

    Differentiable in every tensor argument (every order on ``"reference"`` and ``"torch"``, first order on
    ``"triton"``).

    Args:
        streams: [B, T, n, D], any strides; float16, bfloat16, float32 or float64.
        fn: [(2 + n) n, n D], the projection; rows ``[pre (n) | post (n) | comb (n x n, row-major)]``.
        base: [(2 + n) n], the biases, laid out like ``fn``'s rows.
        scale: [3], the scales of pre, post and comb.
        sinkhorn_iters: Sinkhorn-Knopp iterations, >= 1.
        eps: ``hc_eps`` (> 0): added to ``pre``, to ``comb`` after its softmax and to each Sinkhorn denominator.
        norm_eps: the epsilon of the streams' unweighted RMSNorm (> 0; the model's ``rms_norm_eps``).
        backend: ``"reference"``, ``"torch"``, ``"triton"``, ``"auto"`` or None (see :func:`resolve_backend`).
    Returns:
        ``(post, comb, collapsed)``: post [B, T, n] and comb [B, T, n, n] in float32 (float64 when an input is
        float64); collapsed [B, T, D] in the streams' dtype. ``comb[..., j, k]`` weighs stream j in the new
        stream k.
    Raises:
        ValueError: a shape, dtype or device that does not fit (naming the argument and the allowed values), a
            non-positive ``eps`` / ``norm_eps``, ``sinkhorn_iters < 1``, or a backend that is unknown or cannot
            run on the streams' device.
    """
    check_hyper_connection_inputs(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, head=False)
    return hyper_connection_core(resolve_backend(backend, streams.device), streams, fn, base, scale, sinkhorn_iters,
                                 eps, norm_eps)


def hyper_connection_core(backend: str, streams, fn, base, scale, sinkhorn_iters: int, eps: float, norm_eps: float):
    """:func:`hyper_connection` on a resolved ``backend`` without the input check: for a model, which resolves the
    backend once per forward and passes its own (valid) tensors. Same shapes and results."""
    eps, norm_eps = float(eps), float(norm_eps)
    with autocast_off(streams.device.type):
        if backend == "triton" and triton_computes(streams, weight_dtype(streams, fn, base, scale), streams.dtype):
            return triton_hyper_connection(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, head=False)
        if backend == "reference":
            return hyper_connection_reference(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps)
        return hyper_connection_torch(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps)


def hyper_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    eps: float,
    norm_eps: float,
    backend: str | None = None,
) -> torch.Tensor:
    """The mHC head: ``sum_j pre_j X_j`` with ``pre = sigmoid(scale (fn . RMSNorm(flatten(X))) + base) + eps``.

    Args:
        streams: [B, T, n, D] (as :func:`hyper_connection`).
        fn: [n, n D]. base: [n]. scale: [1].
        eps: ``hc_eps`` (> 0). norm_eps: the streams' RMSNorm epsilon (> 0).
        backend: as :func:`hyper_connection`.
    Returns:
        [B, T, D] in the streams' dtype (weights in float32, float64 when an input is float64).
    Raises:
        ValueError: as :func:`hyper_connection`.
    """
    check_hyper_connection_inputs(streams, fn, base, scale, 1, eps, norm_eps, head=True)
    return hyper_head_core(resolve_backend(backend, streams.device), streams, fn, base, scale, eps, norm_eps)


def hyper_head_core(backend: str, streams, fn, base, scale, eps: float, norm_eps: float) -> torch.Tensor:
    """:func:`hyper_head` on a resolved ``backend`` without the input check (as :func:`hyper_connection_core`)."""
    eps, norm_eps = float(eps), float(norm_eps)
    with autocast_off(streams.device.type):
        if backend == "triton" and triton_computes(streams, weight_dtype(streams, fn, base, scale), streams.dtype):
            return triton_hyper_connection(streams, fn, base, scale, 1, eps, norm_eps, head=True)
        if backend == "reference":
            return hyper_head_reference(streams, fn, base, scale, eps, norm_eps)
        return hyper_head_torch(streams, fn, base, scale, eps, norm_eps)


__all__ = [
    "hyper_connection",
    "hyper_connection_core",
    "hyper_connection_reference",
    "hyper_connection_torch",
    "hyper_connection_weights_reference",
    "hyper_head",
    "hyper_head_core",
    "hyper_head_reference",
    "hyper_head_torch",
    "resolve_backend",
    "sinkhorn_scalings",
    "sinkhorn_vjp",
]
