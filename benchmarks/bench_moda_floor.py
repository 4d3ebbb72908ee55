#!/usr/bin/env python
"""The cost floor of MoDA on this CPU: how far below the measured ratios the issue-10 targets can go at all.

Issue 10 asks for MoDA train step ≤ 1.15× Llama with the FFN-side K/V (``moda``), ≤ 1.06× without it
(``moda-noffn``) and decode ≥ 0.90×. This script measures, in one process with interleaved repeats
(process CPU time, 1 torch thread), the parts of MoDA's extra cost that its design makes unavoidable,
next to the real models, as ratios of Llama's step:

1. **Llama** (transformers' ``LlamaForCausalLM``): the train step of ``benchmarks/bench_models.py`` (forward with
   labels, backward, AdamW step) and a cached one-token decode step (batch 1, ``--cache`` tokens of cache,
   the cache cropped back after each step) — the denominators.
2. **Projection floor** (``moda`` only): the GEMMs MoDA's FFN-side K/V projection adds, at the model's shapes,
   for each of the L - 1 layers that have one: forward ``Y = X W^T`` ([B T, D] x [D, 2 Hkv d]) and both
   backward GEMMs ``dX = dY W``, ``dW = dY^T X``, plus the RoPE of its key (forward and backward); for decode
   the L - 1 matrix-vector products of one token and its key's RoPE. Each layer has its own tensors.
3. **Depth-pool memory floor**: the bytes the depth pool must read per train step with the current algorithm
   (``models/moda/depth_stream.py``; counted by :func:`depth_pool_reads`): each reading layer reads its
   window of K and of V once in the forward (``q·K``, ``P·V``) and once each in the backward (``dO·V``,
   ``dS·K``), and the gradient of each writer's entries reads the stored ``q`` and ``dO`` [N, G, d] of each of
   its readers once (as a fused kernel forming the layer's entries together would; the CPU path since round 3
   forms each entry with one multiply-add per reader, reading them once per entry). Terms without a head-size
   factor (probabilities ``P``,
   ``dS``), the entry writes and the copies of ``q``/``dO`` are left out, so the count is a lower bound. The
   reads are timed as a **read-reduce** (``x.sum()``, single thread) over a contiguous fp32 buffer of each
   read's size; a copy (``y.copy_(x)``) of the same sizes is reported for reference. Each size is timed
   **cold** (right after streaming ``--evict-mib`` MiB, several times the last-level cache, through the
   core) and **hot** (read again at once: whatever fits in cache is still there).
4. **The real models** ``moda`` and ``moda-noffn`` (and the A/A control ``llama-control``) built as in
   ``benchmarks/bench_models.py``, in the same interleave: their train step, decode step and ``generate``
   tokens/s (the issue's decode metric).
5. **The projection in situ**: ``llama+ffnkv``, a Llama whose layers but the last also compute MoDA's FFN-side
   K/V entry (projection, key RoPE, both backward GEMMs, its weights in AdamW) and do nothing else with it:
   the projection's cost inside a real step (caches, optimiser), measured like the models.

Floors: ``train floor = 1 + projection + memory floor`` (ratios of Llama's train step, per repeat, median
over repeats); ``decode ceiling = Llama step / (Llama step + projection)``. The **strict** floor uses the
hot timings (the most favourable the CPU gave), the **cold** floor the cold ones (the windows and weights
do not stay in cache in a real step: each layer's other work streams megabytes through it; the eviction also
evicts the dispatcher's code and data, which a real step may keep warm). The **in-situ** floor is
``llama+ffnkv``'s measured ratio plus the hot memory floor (for decode: Llama's ``generate`` time, or step
time, over ``llama+ffnkv``'s): the check on both. Also recorded: the projection GEMMs' GFLOP/s and a
bytes-only decode ceiling (the projection weights read once, cold, no per-operation cost). The verdict says
whether a target is beyond the strict floor (unreachable on this CPU with this design and algorithm), beyond
the cold or in-situ floor only, or within all of them. Assumption stated with the results: the parts are
added, i.e. a single core does not overlap the projection's compute with the depth pool's memory traffic.

    python benchmarks/bench_moda_floor.py --reps 7                 # the issue's configuration
    python benchmarks/bench_moda_floor.py --reps 7 --kv-heads 2    # paper-like GQA, G = 2

A JSON record is appended to ``docs/bench/moda_floor.jsonl`` (``--no-save``: none).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_models  # noqa: E402
from harness import clock, git_commit, machine_name  # noqa: E402

from depthfusion_hf import MoDAConfig  # noqa: E402
from depthfusion_hf.models.moda.cost import moda_cost  # noqa: E402
from depthfusion_hf.models.moda.modeling_moda import depth_rotary, depth_window, rotate_depth_key  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODELS = ("llama", "llama-control", "moda", "moda-noffn")  # built by bench_models.build_models
IN_SITU = "llama+ffnkv"  # a Llama that also computes MoDA's FFN-side K/V projection, and nothing else of MoDA
VARIANTS = {"moda": True, "moda-noffn": False}  # model name -> moda_ffn_kv
MiB = 2**20


@dataclass(frozen=True)
class Read:
    """One necessary read of the depth pool in a train step: ``what`` by layer ``layer``, ``nbytes`` bytes."""

    what: str
    layer: int
    nbytes: int


def moda_config(args: argparse.Namespace, ffn_kv: bool) -> MoDAConfig:
    """The MoDA config of ``bench_models.py`` for these arguments (heads of 64, MHA unless ``--kv-heads``)."""
    heads = args.hidden // 64
    return MoDAConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_attention_heads=heads, num_key_value_heads=args.kv_heads or heads, vocab_size=args.vocab,
                      moda_ffn_kv=ffn_kv)


def depth_pool_reads(config: MoDAConfig, batch: int, seq: int, itemsize: int = 4) -> list[Read]:
    """The depth pool's necessary reads in one train step of the depth stream, derived from the model's windows.

    With ``N = batch * seq * Hkv`` token rows and slot size ``s = N * d * itemsize`` bytes (one entry, [N, d]):
    reading layer ``l`` with window ``M_l`` slots (``modeling_moda.depth_window``) reads ``M_l s`` bytes of K and
    of V in the forward and again in the backward (4 reads); writer layer ``w`` (whose one or two entries share
    their readers) reads ``q`` and ``dO`` ([N, G, d] each) of each of its ``R_w`` readers once: ``2 G R_w s``
    bytes (the minimum; ``DepthStream.entry_gradient`` reads them once per entry).

    Args:
        config: a ``MoDAConfig``; batch, seq: the train step's B and T; itemsize: bytes per element.
    Returns:
        The reads in step order (forward windows, backward windows, entry gradients).
    Raises:
        ValueError: if the window sizes disagree with ``cost.moda_cost``'s depth-entry count.
    """
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    group = config.num_attention_heads // kv_heads
    slot = batch * seq * kv_heads * head_dim * itemsize
    windows = [depth_window(config, layer) for layer in range(layers)]
    entries = sum(stop - start for start, stop in windows)
    expected = moda_cost(config, seq).depth_entries_per_token
    if entries != expected:
        raise ValueError(f"depth windows read {entries} entries per token, cost.py counts {expected}")
    reads = []
    for phase, kinds in (("forward", ("K (q.K)", "V (P.V)")), ("backward", ("V (dO.V)", "K (dS.K)"))):
        for layer, (start, stop) in enumerate(windows):
            if stop > start:
                reads += [Read(f"{phase} {kind}", layer, (stop - start) * slot) for kind in kinds]
    per_layer = 2 if config.moda_ffn_kv else 1
    for writer in range(layers - 1):
        own = range(writer * per_layer, (writer + 1) * per_layer)
        readers = [r for r, (start, stop) in enumerate(windows) if any(start <= s < stop for s in own)]
        if readers:
            reads.append(Read("entry gradients (q, dO)", writer, 2 * group * len(readers) * slot))
    return reads


class ProjectionWork:
    """The FFN-side K/V projection's work, alone: per layer its own input, weight and output gradient.

    Args:
        config: the ``moda`` config (``L - 1`` projections ``D -> 2 Hkv d``); batch, seq: B, T of the train step.
    """

    def __init__(self, config: MoDAConfig, batch: int, seq: int, dtype: torch.dtype):
        width, kv_heads = config.hidden_size, config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.layers = config.num_hidden_layers - 1
        out = 2 * kv_heads * self.head_dim
        gen = torch.Generator().manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=dtype)

        self.x = [rand(batch, seq, width) for _ in range(self.layers)]  # the FFN input [B, T, D]
        self.w = [rand(out, width) * width**-0.5 for _ in range(self.layers)]  # [2 Hkv d, D]
        self.grad_y = [rand(batch * seq, out) for _ in range(self.layers)]  # [B T, 2 Hkv d]
        self.grad_key = [rand(batch, kv_heads, seq, self.head_dim) for _ in range(self.layers)]
        self.x_token = [rand(1, 1, width) for _ in range(self.layers)]  # one decoded token
        self.rope = depth_rotary(*_rotary_tables(torch.arange(seq), self.head_dim, dtype))
        self.rope_token = depth_rotary(*_rotary_tables(torch.tensor([seq]), self.head_dim, dtype))

    def train(self) -> None:
        """Forward and both backward GEMMs of every projection, and its key's RoPE forward and backward."""
        for x, w, grad_y, grad_key in zip(self.x, self.w, self.grad_y, self.grad_key):
            batch, seq, _ = x.shape
            y = F.linear(x, w)  # (B, T, 2 Hkv d), as nn.Linear
            grad_y.mm(w)  # dX [B T, D]
            grad_y.t().mm(x.view(batch * seq, -1))  # dW [2 Hkv d, D]
            key = y.view(batch, seq, -1, 2, self.head_dim)[..., 0, :].transpose(1, 2)  # (B, Hkv, T, d), as the model
            key = key.detach().requires_grad_()
            torch.autograd.grad(rotate_depth_key(key, self.rope), key, grad_key)

    def decode(self) -> None:
        """One decoded token: the matrix-vector product of every projection and its key's RoPE."""
        with torch.no_grad():
            for x, w in zip(self.x_token, self.w):
                y = F.linear(x, w)  # (1, 1, 2 Hkv d)
                rotate_depth_key(y.view(1, 1, -1, 2, self.head_dim)[..., 0, :].transpose(1, 2), self.rope_token)


class _Attach(torch.autograd.Function):
    """``out`` unchanged, with ``key`` and ``value`` attached to the graph (their gradient: zeros)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.shapes = (key, value)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: D102
        key, value = ctx.shapes
        return grad_out, torch.zeros_like(key), torch.zeros_like(value)


class MLPWithDepthProjection(torch.nn.Module):
    """A Llama MLP that also computes MoDA's FFN-side K/V entry of its input (and nothing else with it).

    ``forward(x [B, T, D]) -> mlp(x)``; on the side ``ffn_kv_proj(x)`` ([B, T, 2 Hkv d], laid out [Hkv, 2, d] as in
    MoDA) and its key's RoPE, attached to the graph so that the backward runs both of the projection's GEMMs
    (the entry's gradient is zeros: MoDA's real one is a depth-pool product, counted in the memory floor).
    """

    def __init__(self, mlp: torch.nn.Module, width: int, kv_heads: int, head_dim: int, max_positions: int):
        super().__init__()
        self.mlp = mlp
        self.ffn_kv_proj = torch.nn.Linear(width, 2 * kv_heads * head_dim, bias=False)
        self.head_dim = head_dim
        # MoDA builds these tables once per forward pass: here once, sliced (positions 0.., cost-equivalent)
        cos, signed_sin = depth_rotary(*_rotary_tables(torch.arange(max_positions), head_dim, torch.float32))
        self.register_buffer("cos", cos, persistent=False)  # [1, 1, P, d]
        self.register_buffer("signed_sin", signed_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        batch, tokens, _ = x.shape
        key, value = self.ffn_kv_proj(x).view(batch, tokens, -1, 2, self.head_dim).unbind(dim=3)
        key = rotate_depth_key(key.transpose(1, 2), (self.cos[:, :, :tokens], self.signed_sin[:, :, :tokens]))
        if not torch.is_grad_enabled():
            return self.mlp(x)
        return _Attach.apply(self.mlp(x), key, value.transpose(1, 2))


def with_depth_projection(model: torch.nn.Module) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` whose layers but the last also compute MoDA's FFN-side K/V (in place; returned)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for layer in model.model.layers[:-1]:
        layer.mlp = MLPWithDepthProjection(layer.mlp, config.hidden_size, config.num_key_value_heads, head_dim,
                                           config.max_position_embeddings)
    return model


def _rotary_tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype,
                   theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's default RoPE ``cos, sin`` [1, T, d] for ``positions`` [T]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class MemoryProbe:
    """Single-thread streaming times over contiguous fp32 buffers: read-reduce (``x.sum()``) and copy.

    Args:
        sizes: the byte sizes to time; evict_bytes: how much to stream through the core before a cold timing.
    """

    def __init__(self, sizes: list[int], evict_bytes: int, dtype: torch.dtype):
        self.sizes = sorted(set(sizes))
        itemsize = torch.empty(0, dtype=dtype).element_size()
        largest = max(self.sizes) // itemsize
        self.src = torch.rand(largest, dtype=dtype)
        self.dst = torch.zeros(largest, dtype=dtype)
        self.evict_buffer = torch.rand(max(evict_bytes // itemsize, 1), dtype=dtype)
        self.itemsize = itemsize

    def evict(self) -> None:
        """Stream the eviction buffer through the core (pushes earlier data out of the caches)."""
        self.evict_buffer.sum()

    def time(self, now: Callable[[], float]) -> dict[str, dict[int, float]]:
        """Seconds per size: ``{"sum_cold", "sum_hot", "copy_cold", "copy_hot"} -> {bytes: seconds}``."""
        out: dict[str, dict[int, float]] = {key: {} for key in ("sum_cold", "sum_hot", "copy_cold", "copy_hot")}
        for nbytes in self.sizes:
            src, dst = self.src[: nbytes // self.itemsize], self.dst[: nbytes // self.itemsize]
            out["sum_cold"][nbytes], out["sum_hot"][nbytes] = hot_and_cold(src.sum, self.evict, now)
            copy = functools.partial(dst.copy_, src)
            out["copy_cold"][nbytes], out["copy_hot"][nbytes] = hot_and_cold(copy, self.evict, now)
        return out


def hot_and_cold(fn: Callable[[], object], evict: Callable[[], None], now: Callable[[], float]) -> tuple[float, float]:
    """``(cold, hot)`` seconds of ``fn()``: right after ``evict()``, then once more at once."""
    evict()
    t0 = now()
    fn()
    cold = now() - t0
    t0 = now()
    fn()
    return cold, now() - t0


def make_decode_step(model: torch.nn.Module, prompt: torch.Tensor, cache_len: int) -> Callable[[], None]:
    """A cached one-token forward (batch 1, ``cache_len`` tokens of cache); the cache is cropped back after it."""
    model.eval()
    with torch.no_grad():
        cache = model(input_ids=prompt[:, :cache_len], use_cache=True).cache
    model.train()
    token = prompt[:, cache_len:cache_len + 1]

    def step() -> None:
        model.eval()
        with torch.no_grad():
            model(input_ids=token, cache=cache, use_cache=True)
        cache.crop(-1)
        model.train()

    return step


def _median_range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (the model options are those of ``benchmarks/bench_models.py``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 64)")
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads of every model (default: MHA)")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repeats")
    parser.add_argument("--cache", type=int, default=48, help="cached tokens of the one-token decode step")
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps timed per repeat and model")
    parser.add_argument("--generate-tokens", type=int, default=64,
                        help="new tokens of the generate() timing (bench_models' decode metric; 0: skip)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt length of the generate() timing")
    parser.add_argument("--evict-mib", type=int, default=128, help="MiB streamed before each cold timing")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=str(REPO / "docs" / "bench" / "moda_floor.jsonl"))
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    if args.hidden % 64 or args.hidden < 64:
        parser.error(f"--hidden must be a positive multiple of 64 (heads of 64); got {args.hidden}")
    if args.layers < 2:
        parser.error(f"--layers must be >= 2 (layer 0 reads no depth entry); got {args.layers}")
    if args.reps < 1 or args.decode_steps < 1:
        parser.error("--reps and --decode-steps must be >= 1")
    return args


def measure(args: argparse.Namespace) -> dict:
    """Run the interleaved measurement; returns the record's ``results`` (per-repeat seconds and the ratios)."""
    dtype, device = torch.float32, torch.device("cpu")
    now = clock(device)
    bench_args = argparse.Namespace(
        layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, kv_heads=args.kv_heads,
        vocab=args.vocab, seq=args.seq, window=4, before=None, models=",".join(MODELS), attn="sdpa",
    )
    models = bench_models.build_models(bench_args, device, dtype)
    bench_args.models = "llama"
    models[IN_SITU] = with_depth_projection(bench_models.build_models(bench_args, device, dtype)["llama"]).train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=gen)
    batch = {"input_ids": ids, "labels": ids}
    prompt = torch.randint(3, args.vocab, (1, max(args.cache, args.prompt) + 1), generator=gen)
    train_steps = {name: bench_models.make_train_step(m, batch) for name, m in models.items()}
    decode_steps = {name: make_decode_step(m, prompt, args.cache) for name, m in models.items()}

    configs = {name: moda_config(args, ffn_kv) for name, ffn_kv in VARIANTS.items()}
    reads = {name: depth_pool_reads(config, args.batch, args.seq) for name, config in configs.items()}
    projection = ProjectionWork(configs["moda"], args.batch, args.seq, dtype)
    weight_bytes = projection.w[0].numel() * projection.w[0].element_size()  # one layer's ffn_kv_proj weight
    probe = MemoryProbe([r.nbytes for rs in reads.values() for r in rs] + [weight_bytes], args.evict_mib * MiB, dtype)

    for name in models:  # warm-up (allocator, optimiser state, caches of the decode path)
        train_steps[name]()
        train_steps[name]()
        decode_steps[name]()
        if args.generate_tokens:
            bench_models.decode_tokens_per_s(models[name], prompt[:, :args.prompt], 2, device)
    projection.train()
    projection.decode()
    probe.time(now)

    train = {name: [] for name in models}
    decode = {name: [] for name in models}
    generate = {name: [] for name in models}
    proj = {key: [] for key in ("train_cold", "train_hot", "decode_cold", "decode_hot")}
    memory: list[dict[str, dict[int, float]]] = []
    for _ in range(args.reps):
        for name, step in train_steps.items():
            t0 = now()
            step()
            train[name].append(now() - t0)
        cold, hot = hot_and_cold(projection.train, probe.evict, now)
        proj["train_cold"].append(cold)
        proj["train_hot"].append(hot)
        pairs = [hot_and_cold(projection.decode, probe.evict, now) for _ in range(args.decode_steps)]
        proj["decode_cold"].append(statistics.median(c for c, _ in pairs))
        proj["decode_hot"].append(statistics.median(h for _, h in pairs))
        memory.append(probe.time(now))
        for name, step in decode_steps.items():
            t0 = now()
            for _ in range(args.decode_steps):
                step()
            decode[name].append((now() - t0) / args.decode_steps)
        if args.generate_tokens:
            for name, model in models.items():
                generate[name].append(1.0 / bench_models.decode_tokens_per_s(
                    model, prompt[:, :args.prompt], args.generate_tokens, device))
    return summarise(args, train, decode, generate, proj, memory, reads, configs, weight_bytes)


def summarise(args, train, decode, generate, proj, memory, reads, configs, weight_bytes: int) -> dict:
    """Ratios per repeat (paired with Llama's repeat), their medians and ranges, the floors and the verdicts.

    Also, for ``moda``: the projection GEMMs' FLOPs and achieved rate, and the decode ceiling set by the bytes
    alone (each projection's weight read once, cold, per token; no per-operation overhead).
    """
    reps = range(args.reps)
    llama_train, llama_decode = train["llama"], decode["llama"]
    results: dict = {"seconds": dict(train=train, decode_step=decode, generate_per_token=generate,
                                     projection=proj)}
    measured = {
        name: {"train": _median_range([train[name][i] / llama_train[i] for i in reps]),
               "decode_step": _median_range([llama_decode[i] / decode[name][i] for i in reps]),
               **({"decode_generate": _median_range([generate["llama"][i] / generate[name][i] for i in reps])}
                  if generate["llama"] else {})}
        for name in train if name != "llama"
    }
    results["measured"] = measured
    bandwidth = {kind: {str(n): _median_range([n / m[kind][n] / 1e9 for m in memory]) for n in memory[0][kind]}
                 for kind in ("sum_cold", "sum_hot")}
    bandwidth.update({kind: {str(n): _median_range([2 * n / m[kind][n] / 1e9 for m in memory]) for n in memory[0][kind]}
                      for kind in ("copy_cold", "copy_hot")})
    results["bandwidth_gb_s"] = bandwidth  # per buffer size; copy counts bytes read + written
    floors = {}
    for name, ffn_kv in VARIANTS.items():
        config = configs[name]
        head_dim = config.hidden_size // config.num_attention_heads
        entry = {"bytes": sum(r.nbytes for r in reads[name]),
                 # the depth attention's matmul FLOPs (cost.py's 4 Hq d per entry and token), forward + backward (x3)
                 "depth_flops_train": 3 * 4 * config.num_attention_heads * head_dim * args.batch * args.seq
                 * moda_cost(config, args.seq).depth_entries_per_token,
                 "reads": [dict(what=r.what, layer=r.layer, nbytes=r.nbytes) for r in reads[name]]}
        for cache in ("hot", "cold"):
            mem_s = [sum(memory[i][f"sum_{cache}"][r.nbytes] for r in reads[name]) for i in reps]
            proj_s = proj[f"train_{cache}"] if ffn_kv else [0.0] * args.reps
            entry[f"memory_s_{cache}"] = _median_range(mem_s)
            entry[f"memory_gb_s_{cache}"] = entry["bytes"] / statistics.median(mem_s) / 1e9
            entry[f"memory_ratio_{cache}"] = _median_range([mem_s[i] / llama_train[i] for i in reps])
            entry[f"projection_ratio_{cache}"] = _median_range([proj_s[i] / llama_train[i] for i in reps])
            entry[f"train_floor_{cache}"] = _median_range([1 + (proj_s[i] + mem_s[i]) / llama_train[i] for i in reps])
            proj_d = proj[f"decode_{cache}"] if ffn_kv else [0.0] * args.reps
            entry[f"decode_ceiling_{cache}"] = _median_range(
                [llama_decode[i] / (llama_decode[i] + proj_d[i]) for i in reps])
            if generate["llama"]:  # the same with generate()'s per-token time as the denominator (a higher ceiling)
                entry[f"decode_ceiling_generate_{cache}"] = _median_range(
                    [generate["llama"][i] / (generate["llama"][i] + proj_d[i]) for i in reps])
        proj_ratio = ([train[IN_SITU][i] / llama_train[i] - 1 for i in reps] if ffn_kv else [0.0] * args.reps)
        mem_hot = [sum(memory[i]["sum_hot"][r.nbytes] for r in reads[name]) / llama_train[i] for i in reps]
        entry["train_floor_in_situ"] = _median_range([1 + proj_ratio[i] + mem_hot[i] for i in reps])
        ceiling = {"step": (decode, "decode_ceiling_in_situ")}
        if generate["llama"]:
            ceiling["generate"] = (generate, "decode_ceiling_generate_in_situ")
        for seconds, key in ceiling.values():
            slower = seconds[IN_SITU] if ffn_kv else seconds["llama"]
            entry[key] = _median_range([seconds["llama"][i] / slower[i] for i in reps])
        floors[name] = entry
    results["floors"] = floors
    config = configs["moda"]
    projections = config.num_hidden_layers - 1
    head_dim = config.hidden_size // config.num_attention_heads
    weight_numel = 2 * config.num_key_value_heads * head_dim * config.hidden_size
    gemm_flops = 3 * 2 * args.batch * args.seq * weight_numel * projections  # forward + 2 backward GEMMs
    weight_read = [projections * memory[i]["sum_cold"][weight_bytes] for i in reps]
    floors["moda"]["projection_gemm_flops"] = gemm_flops
    floors["moda"]["projection_gemm_gflop_s_hot"] = gemm_flops / statistics.median(proj["train_hot"]) / 1e9
    floors["moda"]["projection_weight_bytes"] = projections * weight_bytes
    floors["moda"]["decode_ceiling_bytes"] = _median_range(
        [llama_decode[i] / (llama_decode[i] + weight_read[i]) for i in reps])
    results["verdicts"] = verdicts(measured, floors)
    return results


def verdicts(measured: dict, floors: dict) -> list[dict]:
    """Per target of ``bench_models.TARGETS``: the measured ratio, the strict, cold and in-situ floors, the verdict.

    Train: a target below the strict (hot, isolated) floor is unreachable; below the cold or in-situ floor only, it
    is unreachable unless the real step does better than those measurements. Decode (a bound from above): the
    strict ceiling is the most generous one (hot projection, ``generate`` denominator where timed); the in-situ
    one is ``llama+ffnkv``'s decode ratio (``generate`` where timed).
    """
    rows = []
    for name in VARIANTS:
        for metric in ("train", "decode"):
            target = bench_models.TARGETS[name][metric]
            floor = floors[name]
            if metric == "train":
                strict, cold = floor["train_floor_hot"]["median"], floor["train_floor_cold"]["median"]
                in_situ = floor["train_floor_in_situ"]["median"]
                blocked_strict, blocked_cold, blocked_in_situ = target < strict, target < cold, target < in_situ
                got = measured[name]["train"]["median"]
            else:
                strict = floor.get("decode_ceiling_generate_hot", floor["decode_ceiling_hot"])["median"]
                cold = floor["decode_ceiling_cold"]["median"]
                in_situ = floor.get("decode_ceiling_generate_in_situ", floor["decode_ceiling_in_situ"])["median"]
                blocked_strict, blocked_cold, blocked_in_situ = target > strict, target > cold, target > in_situ
                got = measured[name].get("decode_generate", measured[name]["decode_step"])["median"]
            if blocked_strict:
                verdict = "target beyond the strict floor: unreachable"
            elif blocked_cold or blocked_in_situ:
                verdict = "target beyond the " + " and ".join(
                    n for n, hit in (("cold", blocked_cold), ("in-situ", blocked_in_situ)) if hit) + " floor only"
            else:
                verdict = "target within all floors"
            rows.append(dict(model=name, metric=metric, measured=got, floor_strict=strict, floor_cold=cold,
                             floor_in_situ=in_situ, target=target, target_below_floor_strict=blocked_strict,
                             target_below_floor_cold=blocked_cold, target_below_floor_in_situ=blocked_in_situ,
                             verdict=verdict))
    return rows


def print_report(args: argparse.Namespace, results: dict) -> None:
    """The tables: measured ratios, floor components (bytes, bandwidths), and floor vs target."""
    train_ms = {name: statistics.median(v) * 1e3 for name, v in results["seconds"]["train"].items()}
    decode_ms = {name: statistics.median(v) * 1e3 for name, v in results["seconds"]["decode_step"].items()}
    proj = {k: statistics.median(v) * 1e3 for k, v in results["seconds"]["projection"].items()}
    print(f"\nLlama: train step {train_ms['llama']:.1f} ms, decode step {decode_ms['llama']:.2f} ms "
          f"({args.cache} cached tokens)")
    print(f"{'model':>14} | {'train ms':>9} {'×Llama [min, max]':>24} | {'decode ms':>9} {'step ×Llama':>12} | "
          f"{'generate ×Llama':>15}")
    for name, m in results["measured"].items():
        gen = f"{m['decode_generate']['median']:.3f}" if "decode_generate" in m else "-"
        print(f"{name:>14} | {train_ms[name]:9.1f} {m['train']['median']:6.3f} "
              f"[{m['train']['min']:.3f}, {m['train']['max']:.3f}] | {decode_ms[name]:9.2f} "
              f"{m['decode_step']['median']:12.3f} | {gen:>15}")
    print(f"\nprojection floor (moda): train {proj['train_hot']:.1f} ms hot / {proj['train_cold']:.1f} ms cold; "
          f"decode {proj['decode_hot'] * 1e3:.0f} µs hot / {proj['decode_cold'] * 1e3:.0f} µs cold per step")
    moda = results["floors"]["moda"]
    print(f"  GEMMs {moda['projection_gemm_flops'] / 1e9:.2f} GFLOP at {moda['projection_gemm_gflop_s_hot']:.1f} "
          f"GFLOP/s (hot); weights {moda['projection_weight_bytes'] / MiB:.2f} MiB: decode ceiling from reading them "
          f"once, cold, per token (no per-operation overhead) {moda['decode_ceiling_bytes']['median']:.3f}")
    in_situ = results["measured"][IN_SITU]
    gen = f", generate {in_situ['decode_generate']['median']:.3f}" if "decode_generate" in in_situ else ""
    print(f"projection in situ ({IN_SITU} ×Llama): train {in_situ['train']['median']:.3f} "
          f"[{in_situ['train']['min']:.3f}, {in_situ['train']['max']:.3f}], decode step "
          f"{in_situ['decode_step']['median']:.3f}{gen}")
    print(f"{'variant':>11} | {'depth reads MiB':>15} | {'read GB/s hot':>13} {'cold':>6} | "
          f"{'memory ×Llama hot':>17} {'cold':>6} | {'proj ×Llama hot':>15} {'cold':>6} | {'depth GFLOP':>11}")
    for name, f in results["floors"].items():
        print(f"{name:>11} | {f['bytes'] / MiB:15.1f} | {f['memory_gb_s_hot']:13.2f} {f['memory_gb_s_cold']:6.2f} | "
              f"{f['memory_ratio_hot']['median']:17.3f} {f['memory_ratio_cold']['median']:6.3f} | "
              f"{f['projection_ratio_hot']['median']:15.3f} {f['projection_ratio_cold']['median']:6.3f} | "
              f"{f['depth_flops_train'] / 1e9:11.3f}")
    bw = results["bandwidth_gb_s"]
    sizes = sorted(int(n) for n in bw["sum_cold"])
    print("single-thread bandwidth GB/s by buffer size (sum = read-reduce, copy = read + write bytes):")
    for n in sizes:
        print(f"  {n / MiB:7.2f} MiB: sum cold {bw['sum_cold'][str(n)]['median']:6.2f}  hot "
              f"{bw['sum_hot'][str(n)]['median']:6.2f} | copy cold {bw['copy_cold'][str(n)]['median']:6.2f}  hot "
              f"{bw['copy_hot'][str(n)]['median']:6.2f}")
    print(f"\n{'model':>11} {'metric':>7} | {'measured':>8} | {'floor strict':>12} {'cold':>6} {'in situ':>7} | "
          f"{'target':>6} | verdict   (train: floor = 1 + projection + memory; decode: ceiling)")
    for row in results["verdicts"]:
        print(f"{row['model']:>11} {row['metric']:>7} | {row['measured']:8.3f} | {row['floor_strict']:12.3f} "
              f"{row['floor_cold']:6.3f} {row['floor_in_situ']:7.3f} | {row['target']:6.2f} | {row['verdict']}")


def main(argv: list[str] | None = None) -> dict:
    """Measure, print the tables, append the record (unless ``--no-save``); returns the record."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_name(torch.device("cpu"))
    print(f"# bench_moda_floor  machine: {machine}  torch {torch.__version__}  commit {git_commit()}")
    print(f"# {args.layers} layers, hidden {args.hidden}, KV heads {args.kv_heads or args.hidden // 64} of "
          f"{args.hidden // 64}, MLP {args.intermediate}, vocab {args.vocab}, batch {args.batch} × seq {args.seq}, "
          f"fp32; {args.reps} interleaved reps, process CPU time, {args.threads} thread(s)")
    results = measure(args)
    print_report(args, results)
    record = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), machine=machine,
                  command="python benchmarks/bench_moda_floor.py "
                  + " ".join(argv if argv is not None else sys.argv[1:]),
                  label=args.label, torch=torch.__version__, commit=git_commit(), args=vars(args), results=results)
    if not args.no_save:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"\nappended to {out}")
    return record


if __name__ == "__main__":
    main()
