"""Step ``speed``: speed and peak memory of each op's Triton path against its baseline (medians of CUDA-event
timings after warm-up, forward and forward + backward), bf16:

- MoDA (B 1, 16 query heads, 8 KV heads, d 128, M 16 depth entries) against SDPA on the same sequence pool
  (``enable_gqa``, the flash backend where it applies) and against flash-attn's ``flash_attn_func`` when installed,
  at T = 8K, 32K, 64K (the paper: MoDA at 97.3 % of FlashAttention-2's speed at 64K). The reported ratio is
  baseline time / MoDA time (the fraction of the baseline's speed).
- DWA (25 sources of [8, 4096, 1024]): achieved bandwidth against a device copy of the same bytes.
- AttnRes (17 sources of [4, 4096, 2048]): Triton against the PyTorch path.
- mHC (n = 4 streams of [4, 4096, 2048], bf16): the hyper-connection (20 Sinkhorn iterations) and the mix, Triton
  against the PyTorch path (issue 22's GPU target).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEVICE, Result, cuda_time, peak_bytes, size, step_main  # noqa: E402


def _fwd_bwd(fn, leaves, grad):
    import torch

    def call():
        out = fn()
        torch.autograd.grad(out, leaves, grad)
    return call


def moda_vs_sdpa(result: Result, seq: int) -> None:
    import torch
    import torch.nn.functional as F

    from depthfusion_hf.ops import moda_attention

    dt, (B, Hq, Hkv, d, M) = torch.bfloat16, size((1, 16, 8, 128, 16), (1, 4, 2, 16, 3))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    mk = lambda *s: torch.randn(s, generator=gen, device=DEVICE, dtype=dt).requires_grad_()  # noqa: E731
    q, k, v = mk(B, Hq, seq, d), mk(B, Hkv, seq, d), mk(B, Hkv, seq, d)
    dk, dv = mk(B, Hkv, seq, M, d), mk(B, Hkv, seq, M, d)
    grad = torch.randn(B, Hq, seq, d, generator=gen, device=DEVICE, dtype=dt)
    reps = 10 if seq <= 8192 else 5
    moda = lambda: moda_attention(q, k, v, dk, dv, backend="triton")  # noqa: E731
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    row = dict(T=seq, B=B, Hq=Hq, Hkv=Hkv, d=d, M=M)
    with torch.no_grad():
        t_moda, t_sdpa = cuda_time(moda, reps), cuda_time(sdpa, reps)
    row.update(fwd_moda_ms=t_moda["median_ms"], fwd_sdpa_ms=t_sdpa["median_ms"],
               fwd_fraction_of_sdpa=t_sdpa["median_ms"] / t_moda["median_ms"])
    b_moda = cuda_time(_fwd_bwd(moda, (q, k, v, dk, dv), grad), reps)
    b_sdpa = cuda_time(_fwd_bwd(sdpa, (q, k, v), grad), reps)
    row.update(fwd_bwd_moda_ms=b_moda["median_ms"], fwd_bwd_sdpa_ms=b_sdpa["median_ms"],
               fwd_bwd_fraction_of_sdpa=b_sdpa["median_ms"] / b_moda["median_ms"],
               peak_moda_bytes=peak_bytes(_fwd_bwd(moda, (q, k, v, dk, dv), grad)),
               peak_sdpa_bytes=peak_bytes(_fwd_bwd(sdpa, (q, k, v), grad)))
    try:
        from flash_attn import flash_attn_func
    except Exception as exc:  # noqa: BLE001 - an optional package
        row["flash_attn"] = f"not installed ({type(exc).__name__})"
    else:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        fa = lambda: flash_attn_func(qt, kt, vt, causal=True)  # noqa: E731
        with torch.no_grad():
            t_fa = cuda_time(fa, reps)
        b_fa = cuda_time(_fwd_bwd(fa, (qt, kt, vt), grad.transpose(1, 2).contiguous()), reps)
        row.update(fwd_fa2_ms=t_fa["median_ms"], fwd_fraction_of_fa2=t_fa["median_ms"] / t_moda["median_ms"],
                   fwd_bwd_fa2_ms=b_fa["median_ms"], fwd_bwd_fraction_of_fa2=b_fa["median_ms"] / b_moda["median_ms"])
    result.measure(f"moda vs sdpa T={seq}", **row)


def dwa_bandwidth(result: Result) -> None:
    import torch

    from depthfusion_hf.ops import depth_weighted_average

    n, shape = size((25, (8, 4096, 1024)), (3, (2, 8, 16)))
    xs = [torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) for _ in range(n)]
    w = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        t = cuda_time(lambda: depth_weighted_average(xs, w, backend="triton"))
        t_torch = cuda_time(lambda: depth_weighted_average(xs, w, backend="torch"))
        big = torch.empty((n + 1) * xs[0].numel() // 2, device=DEVICE, dtype=torch.bfloat16)
        t_copy = cuda_time(lambda: big.clone())  # reads and writes (N + 1) / 2 sources' bytes: (N + 1) moved in all
    moved = (n + 1) * xs[0].numel() * 2
    result.measure("dwa forward bandwidth", N=n, shape=list(shape), triton_ms=t["median_ms"],
                   torch_ms=t_torch["median_ms"], copy_ms=t_copy["median_ms"],
                   triton_GBps=moved / t["median_ms"] / 1e6, copy_GBps=moved / t_copy["median_ms"] / 1e6,
                   fraction_of_copy=t_copy["median_ms"] / t["median_ms"])


def attnres_speed(result: Result) -> None:
    import torch

    from depthfusion_hf.ops import attention_residual

    n, shape = size((17, (4, 4096, 2048)), (3, (2, 8, 32)))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    xs = [torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.bfloat16).requires_grad_() for _ in range(n)]
    query = (0.05 * torch.randn(shape[-1], generator=gen, device=DEVICE)).requires_grad_()
    g = torch.ones(shape[-1], device=DEVICE).requires_grad_()
    grad = torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    row = dict(N=n, shape=list(shape))
    for backend in ("triton", "torch"):
        fn = lambda b=backend: attention_residual(query, xs, g, backend=b)  # noqa: E731
        with torch.no_grad():
            row[f"fwd_{backend}_ms"] = cuda_time(fn)["median_ms"]
        row[f"fwd_bwd_{backend}_ms"] = cuda_time(_fwd_bwd(fn, [query, g, *xs], grad))["median_ms"]
        row[f"peak_{backend}_bytes"] = peak_bytes(_fwd_bwd(fn, [query, g, *xs], grad))
    row["fwd_bwd_speedup_over_torch"] = row["fwd_bwd_torch_ms"] / row["fwd_bwd_triton_ms"]
    result.measure("attnres triton vs torch", **row)


def mhc_speed(result: Result) -> None:
    """The hyper-connection (20 Sinkhorn iterations) and the mix, bf16 streams with fp32 weights (as the model runs
    them): Triton against the PyTorch path, forward and forward + backward."""
    import torch

    from depthfusion_hf.ops import hyper_connection, hyper_mix

    batch, tokens, n, dim = size((4, 4096, 4, 2048), (2, 8, 4, 32))
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return (scale * torch.randn(shape, generator=gen, device=DEVICE)).to(dtype).requires_grad_()

    streams = randn(batch, tokens, n, dim, dtype=torch.bfloat16)
    fn, base = randn((2 + n) * n, n * dim, scale=(n * dim) ** -0.5), randn((2 + n) * n)
    scale = (1 + 0.3 * torch.randn(3, generator=gen, device=DEVICE)).requires_grad_()
    output = randn(batch, tokens, dim, dtype=torch.bfloat16)
    post = (2 * torch.rand(batch, tokens, n, generator=gen, device=DEVICE)).requires_grad_()
    comb = torch.rand(batch, tokens, n, n, generator=gen, device=DEVICE).requires_grad_()
    ops = {
        "connection": (lambda b: hyper_connection(streams, fn, base, scale, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6,
                                                  backend=b), [streams, fn, base, scale]),
        "mix": (lambda b: (hyper_mix(streams, output, post, comb, backend=b),), [streams, output, post, comb]),
    }
    for name, (op, leaves) in ops.items():
        with torch.no_grad():
            grads = [torch.randn(o.shape, generator=gen, device=DEVICE).to(o.dtype) for o in op("torch")]
        row = dict(B=batch, T=tokens, n=n, D=dim)
        for backend in ("triton", "torch"):
            call = lambda b=backend, o=op: o(b)  # noqa: E731
            with torch.no_grad():
                row[f"fwd_{backend}_ms"] = cuda_time(call)["median_ms"]
            row[f"fwd_bwd_{backend}_ms"] = cuda_time(_fwd_bwd(call, leaves, grads))["median_ms"]
            row[f"peak_{backend}_bytes"] = peak_bytes(_fwd_bwd(call, leaves, grads))
        row["fwd_speedup_over_torch"] = row["fwd_torch_ms"] / row["fwd_triton_ms"]
        row["fwd_bwd_speedup_over_torch"] = row["fwd_bwd_torch_ms"] / row["fwd_bwd_triton_ms"]
        result.measure(f"mhc {name} triton vs torch", **row)


def run(result: Result, args) -> None:
    for seq in size((8192, 32768, 65536), (64,)):
        result.attempt(f"moda vs sdpa T={seq}", lambda s=seq: moda_vs_sdpa(result, s))
    result.attempt("dwa forward bandwidth", lambda: dwa_bandwidth(result))
    result.attempt("attnres triton vs torch", lambda: attnres_speed(result))
    result.attempt("mhc triton vs torch", lambda: mhc_speed(result))


if __name__ == "__main__":
    step_main(run)
