"""Step ``ops``: every op's Triton path against its PyTorch path at realistic shapes, values and gradients.

Each case runs the public op (``depthfusion_hf.ops``) three times on the same inputs: ``backend="triton"``,
``backend="torch"`` in the same dtype, and ``backend="torch"`` in float64 (the oracle). The Triton output and every
input gradient must be within :func:`common.tolerance` of the oracle: twice the larger of the PyTorch path's own
error in that dtype and the dtype's unit roundoff. TF32 is off (``allow_tf32 = False``), so fp32 is held to fp32.
Most important first: MoDA at d = 128, T = 2048-8192, M up to 2L (L = 36 layers: 72 entries), padded, decoding,
the large case whose depth offsets pass 2**31 elements (the model's slot-major buffer), autocast with RoPE's mixed
dtypes; then AttnRes, mHC (the hyper-connection with 20 Sinkhorn iterations, the head and the mix: bf16 streams with
fp32 weights, as the model runs them, and fp32) and DWA.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEVICE, SMOKE, Result, compare, size, step_main, sync  # noqa: E402

SEED = 0


def _leaves(tensors: dict, dtype_of: Callable) -> dict:
    return {name: t.detach().to(dtype_of(name, t)).requires_grad_() if t.is_floating_point() else t
            for name, t in tensors.items()}


def _run(call, leaves: dict, grads_out, autocast=None):
    import torch

    floating = [name for name, t in leaves.items() if t.requires_grad]
    with torch.autocast(DEVICE, dtype=autocast) if autocast is not None else torch.autocast(DEVICE, enabled=False):
        out = call(leaves)
    outs = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad(outs, [leaves[n] for n in floating], [g.to(o.dtype) for g, o in zip(grads_out, outs)])
    return [o.detach() for o in outs], dict(zip(floating, grads))


def op_check(result: Result, name: str, call, inputs: dict, dtype, *, dtype_of=None, autocast=None) -> None:
    """``call(tensors, backend)`` on ``inputs`` cast by ``dtype_of(name, tensor)`` (default: floating ones to
    ``dtype``); the Triton path against the oracle, bounded by the PyTorch path in the same dtype."""
    import torch

    dtype_of = dtype_of or (lambda _n, t: dtype if t.is_floating_point() else t.dtype)
    with torch.no_grad():
        probe = call(_leaves(inputs, dtype_of), "torch")
    probes = probe if isinstance(probe, tuple) else (probe,)
    gen = torch.Generator(device=DEVICE).manual_seed(SEED + 1)
    grads_out = [torch.randn(p.shape, generator=gen, device=DEVICE, dtype=torch.float32) for p in probes]
    del probe, probes
    runs = {}
    for backend in ("triton", "torch"):
        runs[backend] = _run(lambda ts, b=backend: call(ts, b), _leaves(inputs, dtype_of), grads_out, autocast)
    runs["oracle"] = _run(lambda ts: call(ts, "torch"),
                          _leaves(inputs, lambda n, t: torch.float64 if t.is_floating_point() else t.dtype), grads_out)
    (out_t, grad_t), (out_b, grad_b), (out_o, grad_o) = runs["triton"], runs["torch"], runs["oracle"]
    compute = autocast or dtype
    for i, (a, b, o) in enumerate(zip(out_t, out_b, out_o)):
        compare(result, f"{name}: output {i}", a, b, o, compute)
    for key in grad_o:
        compare(result, f"{name}: d{key}", grad_t[key], grad_b[key], grad_o[key], compute)


_SEEDS = itertools.count(SEED + 100)  # every tensor its own seed: equal shapes must not give equal sources


def _randn(*shape, scale=1.0):
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(next(_SEEDS))
    return torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.float32) * scale


def moda_inputs(batch, q_heads, kv_heads, seq, head_dim, depth, *, past=0, padded=False) -> dict:
    import torch

    kv_len = past + seq
    inputs = dict(q=_randn(batch, q_heads, seq, head_dim), k=_randn(batch, kv_heads, kv_len, head_dim),
                  v=_randn(batch, kv_heads, kv_len, head_dim),
                  depth_k=_randn(batch, kv_heads, seq, depth, head_dim),
                  depth_v=_randn(batch, kv_heads, seq, depth, head_dim))
    if padded:  # left padding of a quarter of the first row: a bool mask [B, 1, 1, S]
        mask = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool, device=DEVICE)
        mask[0, ..., : kv_len // 4] = False
        inputs["attention_mask"] = mask
    return inputs


def _moda_call(ts, backend):
    from depthfusion_hf.ops import moda_attention

    ts = dict(ts)
    return moda_attention(ts.pop("q"), ts.pop("k"), ts.pop("v"), ts.pop("depth_k"), ts.pop("depth_v"),
                          backend=backend, **ts)


def _dwa_call(ts, backend):
    from depthfusion_hf.ops import depth_weighted_average

    sources = [ts[f"x{i}"] for i in range(len(ts) - 1)]
    return depth_weighted_average(sources, ts["w"], backend=backend)


def _attnres_call(ts, backend):
    from depthfusion_hf.ops import attention_residual

    sources = [ts[f"v{i}"] for i in range(len(ts) - 2)]
    return attention_residual(ts["query"], sources, ts["g"], return_weights=True, backend=backend)


def mhc_inputs(batch, tokens, n, dim, *, head=False) -> dict:
    """The hyper-connection's (or head's) inputs: projections of order 1 (``fn . RMSNorm(x)`` ~ N(0, 1)), random
    biases and scales around 1, so the weights are far from uniform and the Sinkhorn loop has work to do."""
    rows = n if head else (2 + n) * n
    return {"streams": _randn(batch, tokens, n, dim), "fn": _randn(rows, n * dim, scale=(n * dim) ** -0.5),
            "base": _randn(rows), "scale": 1 + _randn(1 if head else 3, scale=0.3)}


def mix_inputs(batch, tokens, n, dim) -> dict:
    """The mix's inputs: streams, a sub-layer output, post in (0, 2) and a non-symmetric comb in (0, 1)."""
    return {"streams": _randn(batch, tokens, n, dim), "output": _randn(batch, tokens, dim),
            "post": 1 + _randn(batch, tokens, n, scale=0.5).tanh(), "comb": _randn(batch, tokens, n, n).sigmoid()}


def _connection_call(ts, backend):
    from depthfusion_hf.ops import hyper_connection

    return hyper_connection(ts["streams"], ts["fn"], ts["base"], ts["scale"], sinkhorn_iters=20, eps=1e-6,
                            norm_eps=1e-6, backend=backend)


def _head_call(ts, backend):
    from depthfusion_hf.ops import hyper_head

    return hyper_head(ts["streams"], ts["fn"], ts["base"], ts["scale"], eps=1e-6, norm_eps=1e-6, backend=backend)


def _mix_call(ts, backend):
    from depthfusion_hf.ops import hyper_mix

    return hyper_mix(ts["streams"], ts["output"], ts["post"], ts["comb"], backend=backend)


def moda_large_offsets(result: Result) -> None:
    """Depth entries as the model keeps them, a slot-major buffer [M, B, T, Hkv, d] read through a permuted view:
    the slot stride B*T*Hkv*d times M passes 2**31 elements. The last batch row of the Triton result (forward and
    gradients) is compared with the op on that row alone (small offsets), Triton and PyTorch."""
    import torch

    from depthfusion_hf.ops import moda_attention

    batch, q_heads, kv_heads, seq, head_dim, depth = size((8, 16, 8, 4096, 128, 72), (3, 4, 2, 16, 16, 5))
    elements = depth * batch * seq * kv_heads * head_dim
    need = 4 * elements * 2 + 6 * batch * q_heads * seq * head_dim * 2
    free = torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else need / 0.5
    if need > 0.8 * free:
        result.check("moda large offsets: skipped, not enough GPU memory", True, need_gib=need / 2**30,
                     free_gib=free / 2**30)
        return
    dt = torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(SEED)
    q = torch.randn(batch, q_heads, seq, head_dim, generator=gen, device=DEVICE, dtype=dt).requires_grad_()
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=gen, device=DEVICE, dtype=dt).requires_grad_()
    v = torch.randn(batch, kv_heads, seq, head_dim, generator=gen, device=DEVICE, dtype=dt).requires_grad_()
    buf_k = torch.randn(depth, batch, seq, kv_heads, head_dim, generator=gen, device=DEVICE, dtype=dt)
    buf_v = torch.randn(depth, batch, seq, kv_heads, head_dim, generator=gen, device=DEVICE, dtype=dt)
    buf_k.requires_grad_()
    buf_v.requires_grad_()
    depth_k, depth_v = buf_k.permute(1, 3, 2, 0, 4), buf_v.permute(1, 3, 2, 0, 4)  # [B, Hkv, T, M, d] views
    result.note("moda_large_offsets", dict(shape=[batch, q_heads, kv_heads, seq, head_dim, depth],
                                           max_depth_offset=int((depth - 1) * depth_k.stride(3) + (batch - 1)
                                                                * depth_k.stride(0)), limit=2**31))
    grad = torch.randn(batch, q_heads, seq, head_dim, generator=gen, device=DEVICE, dtype=dt)
    out = moda_attention(q, k, v, depth_k, depth_v, backend="triton")
    gq, gk, gv, gdk, gdv = torch.autograd.grad(out, (q, k, v, buf_k, buf_v), grad)
    last = slice(batch - 1, batch)
    row = [t[last].detach().clone() for t in (q, k, v)] + [t.detach()[:, last].clone() for t in (buf_k, buf_v)]
    row_grad = grad[last]

    def reference(backend, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in row]
        o = moda_attention(leaves[0], leaves[1], leaves[2], leaves[3].permute(1, 3, 2, 0, 4),
                           leaves[4].permute(1, 3, 2, 0, 4), backend=backend)
        return o.detach(), torch.autograd.grad(o, leaves, row_grad.to(dtype))

    out_b, grads_b = reference("torch", dt)
    out_o, grads_o = reference("torch", torch.float64)
    compare(result, "moda large offsets (last batch row): output", out[last], out_b, out_o, dt)
    for name, g_t, g_b, g_o in zip(("dq", "dk", "dv", "d_depth_k", "d_depth_v"),
                                   (gq[last], gk[last], gv[last], gdk[:, last], gdv[:, last]), grads_b, grads_o):
        compare(result, f"moda large offsets (last batch row): {name}", g_t, g_b, g_o, dt)


def run(result: Result, args) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    result.note("smoke", SMOKE)
    # toy shapes in a smoke run: a [B, Hq, Hkv, T, d, M] (or [N, B, T, D]) tuple is replaced, same code
    S = lambda real, small: size(real, small)  # noqa: E731
    m1 = S((4, 16, 8, 2048, 128, 16), (2, 4, 2, 40, 16, 3))
    m2 = S((1, 16, 8, 8192, 128, 72), (1, 4, 2, 64, 16, 6))
    m3 = S((2, 16, 4, 4096, 128, 8), (2, 4, 1, 48, 16, 2))
    dec = S((8, 16, 8, 128, 72, 8191), (2, 4, 2, 16, 6, 37))
    a1, a2, a3 = S((17, 4, 4096, 2048), (3, 2, 8, 32)), S((9, 4, 4096, 2048), (3, 2, 8, 32)), \
        S((9, 2, 2048, 2048), (3, 2, 8, 32))
    d1, d2, d3 = S((25, 8, 4096, 1024), (3, 2, 8, 16)), S((13, 8, 4096, 1024), (3, 2, 8, 16)), \
        S((13, 4, 4096, 1024), (3, 2, 8, 16))

    h1, h2 = S((2, 4096, 4, 2048), (2, 9, 4, 20)), S((1, 8192, 4, 4096), (1, 5, 3, 70))
    streams_bf16 = dict(dtype_of=lambda n, t: bf16 if n in ("streams", "output") else fp32)

    def attnres_inputs(n, b, t, d):
        return {"query": _randn(d, scale=0.05), "g": 1 + _randn(d, scale=0.1),
                **{f"v{i}": _randn(b, t, d) for i in range(n)}}

    def dwa_inputs(n, b, t, d):
        return {"w": _randn(n, scale=0.2), **{f"x{i}": _randn(b, t, d) for i in range(n)}}

    cases = [
        (f"moda bf16 B{m1[0]} Hq{m1[1]} Hkv{m1[2]} T{m1[3]} d{m1[4]} M{m1[5]}", bf16, lambda: moda_inputs(*m1), {}),
        (f"moda bf16 B{m2[0]} Hq{m2[1]} Hkv{m2[2]} T{m2[3]} d{m2[4]} M{m2[5]} (M = 2L)", bf16,
         lambda: moda_inputs(*m2), {}),
        (f"moda bf16 B{m3[0]} Hq{m3[1]} Hkv{m3[2]} T{m3[3]} d{m3[4]} M{m3[5]} left-padded", bf16,
         lambda: moda_inputs(*m3, padded=True), {}),
        (f"moda bf16 decode B{dec[0]} S{dec[5] + 1} d{dec[3]} M{dec[4]}", bf16,
         lambda: moda_inputs(dec[0], dec[1], dec[2], 1, dec[3], dec[4], past=dec[5]), {}),
        ("moda large offsets", None, None, {}),
        ("moda autocast-bf16 mixed (q, k fp32; v, depth bf16)", bf16, lambda: moda_inputs(*m1),
         dict(autocast=bf16, dtype_of=lambda n, t: fp32 if n in ("q", "k") else bf16)),
        (f"moda fp16 B{m1[0]} T{m1[3]} d{m1[4]} M{m1[5]}", fp16, lambda: moda_inputs(*m1), {}),
        (f"moda fp32 B{m1[0]} T{m1[3]} d{m1[4]} M{m1[5]}", fp32, lambda: moda_inputs(*m1), {}),
        (f"attnres bf16 N{a1[0]} {list(a1[1:])} (query, g fp32)", bf16, lambda: attnres_inputs(*a1),
         dict(dtype_of=lambda n, t: fp32 if n in ("query", "g") else bf16)),
        ("attnres autocast-bf16 mixed sources (embedding fp32, outputs bf16)", bf16, lambda: attnres_inputs(*a2),
         dict(autocast=bf16, dtype_of=lambda n, t: fp32 if n in ("query", "g", "v0") else bf16)),
        (f"attnres fp32 N{a3[0]} {list(a3[1:])}", fp32, lambda: attnres_inputs(*a3), {}),
        (f"mhc connection bf16 streams B{h1[0]} T{h1[1]} n{h1[2]} D{h1[3]} (weights fp32, 20 iterations)", bf16,
         lambda: mhc_inputs(*h1), streams_bf16),
        (f"mhc connection bf16 streams B{h2[0]} T{h2[1]} n{h2[2]} D{h2[3]}", bf16, lambda: mhc_inputs(*h2),
         streams_bf16),
        (f"mhc head bf16 streams B{h1[0]} T{h1[1]} n{h1[2]} D{h1[3]}", bf16, lambda: mhc_inputs(*h1, head=True),
         streams_bf16),
        (f"mhc mix bf16 streams B{h1[0]} T{h1[1]} n{h1[2]} D{h1[3]} (post, comb fp32)", bf16,
         lambda: mix_inputs(*h1), streams_bf16),
        (f"mhc connection fp32 B{h1[0]} T{h1[1]} n{h1[2]} D{h1[3]}", fp32, lambda: mhc_inputs(*h1), {}),
        (f"mhc mix fp32 B{h1[0]} T{h1[1]} n{h1[2]} D{h1[3]}", fp32, lambda: mix_inputs(*h1), {}),
        (f"dwa bf16 N{d1[0]} {list(d1[1:])}", bf16, lambda: dwa_inputs(*d1), {}),
        (f"dwa autocast-bf16 fp32 inputs N{d2[0]} {list(d2[1:])}", fp32, lambda: dwa_inputs(*d2), dict(autocast=bf16)),
        (f"dwa fp32 N{d3[0]} {list(d3[1:])}", fp32, lambda: dwa_inputs(*d3), {}),
    ]
    calls = {"moda": _moda_call, "attnres": _attnres_call, "dwa": _dwa_call, "mhc connection": _connection_call,
             "mhc head": _head_call, "mhc mix": _mix_call}  # by the case name's prefix
    for name, dtype, inputs, options in cases:
        if name == "moda large offsets":
            result.attempt(name, lambda: moda_large_offsets(result))
            continue
        call = next(c for prefix, c in calls.items() if name.startswith(prefix + " "))
        result.attempt(name, lambda n=name, c=call, i=inputs, d=dtype, o=options: op_check(result, n, c, i(), d, **o))
        sync()


if __name__ == "__main__":
    step_main(run)
