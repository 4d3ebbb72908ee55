"""Ahead-of-time compilation of every Triton launch the package makes, for sm_80 and sm_90, without a GPU.

Two phases, each in its own process (``python -m tests.kernels.aot record|compile``):

1. **record**: drive the package's public ops and model forwards / backwards / decoding on CPU tensors
   that *look like* CUDA tensors (:func:`fake_cuda`: ``Tensor.device`` reports ``cuda:0``, factory calls
   asked for CUDA allocate on the CPU, ``torch.cuda`` answers as one device of ``SM_COUNT`` multiprocessors,
   autocast for ``"cuda"`` is CPU autocast), so the launch code takes its CUDA branch (tile sizes, warps,
   grids, dot precision) exactly as on a GPU. Kernels are real ``JITFunction`` objects (``TRITON_INTERPRET``
   unset). Each launch is intercepted at the Triton runtime boundary (:func:`record_launches`): Triton's
   own binder specialises the arguments (dtypes, constexprs, integers equal to 1, divisibility by 16 of
   pointers and integers) against a stand-in driver for sm_90, the compile is skipped through
   ``knobs.runtime.jit_cache_hook``, and nothing runs (outputs stay uninitialised; no value is checked).
2. **compile**: each distinct specialisation is compiled with ``triton.compile(ASTSource(fn, signature,
   constexprs, attrs), target=GPUTarget("cuda", cc, 32))`` for each target (the wheel's ptxas), and its
   registers, spills and dynamic shared memory are read off the compiled kernel; :func:`problems` says
   what is wrong with a result (no compile, shared memory past the target's limit, spills in a bf16 /
   fp16 configuration, a grid past CUDA's limits).

A case (:data:`CASES`) is one way a user reaches the kernels: ``<family>/<level>/<dtype>/<what>``, op level
(the public ``depthfusion_hf.ops`` functions with ``backend="triton"``) or model level (the families'
forward + backward under autocast, decoding with a cache). Cases name only public entry points, so they
survive rewrites of the launch code; the kernels and their specialisations are whatever the launch code
produces. ``tests/kernels/test_aot_compile.py`` runs a covering subset in CI; ``benchmarks/aot_sweep.py``
runs them all and writes the table.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import hashlib
import importlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

# Compute capability -> largest dynamic shared memory a block may opt into (CUDA programming guide,
# "Technical Specifications per Compute Capability": 163 KB on 8.0, 227 KB on 9.0).
TARGETS = {80: 163 * 1024, 90: 227 * 1024}
GRID_LIMITS = (2**31 - 1, 65535, 65535)
SM_COUNT = 132  # H100 / H200 SXM; the launch code may size persistent grids from it
HALF_TYPES = ("*bf16", "*fp16")


# ------------------------------------------------------------------------------------------------
# Fake CUDA: CPU tensors that the launch code takes for CUDA tensors
# ------------------------------------------------------------------------------------------------

_CUDA0 = torch.device("cuda", 0)
_CPU = torch.device("cpu")


def _to_cpu_device(value):
    """A device argument asked for CUDA, as the CPU; anything else unchanged."""
    if isinstance(value, torch.device) and value.type == "cuda":
        return _CPU
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    return value


class _CpuForCuda(torch.overrides.TorchFunctionMode):
    """Every torch call that asks for a CUDA device gets the CPU; ``.cuda()`` and pinning are no-ops.

    A torch-function mode, not a dispatch mode: the package changes path under a dispatch mode (it takes
    one for a FLOP counter or fake tensors). Torch pops the mode while the function it intercepted runs, so
    an autograd backward entered through ``Tensor.backward`` would run without it: :func:`backward` enters
    the autograd engine directly instead, and those entry points raise here.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad):
            raise RuntimeError("under fake_cuda(), run backwards with tests.kernels.aot.backward(outputs)")
        kwargs = {k: _to_cpu_device(v) for k, v in (kwargs or {}).items()}
        args = tuple(_to_cpu_device(a) for a in args)
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.is_pinned:
            return True
        return func(*args, **kwargs)


def backward(outputs) -> None:
    """``torch.autograd.backward(outputs, uninitialised gradients)`` with the fake-CUDA mode kept active inside."""
    from torch.autograd.graph import _engine_run_backward

    outputs = [o for o in ([outputs] if isinstance(outputs, torch.Tensor) else outputs) if o.requires_grad]
    grads = [torch.empty_like(o) if o.dim() else torch.ones_like(o) for o in outputs]
    _engine_run_backward(tuple(outputs), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)


class _FakeStream:
    """Stands in for ``torch.cuda.Stream``: stream 0 of cuda:0."""

    cuda_stream = 0
    device = _CUDA0
    device_index = 0

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return None

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _FakeStream)

    def __hash__(self):
        return 0


class _NullContext:
    """Stands in for ``torch.cuda.device(...)`` / ``torch.cuda.stream(...)``: enters, does nothing."""

    def __init__(self, *args, **kwargs):
        self.idx = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _device_properties(sm_count: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="fake sm_90 (depthfusion AOT harness)", major=9, minor=0, multi_processor_count=sm_count,
        total_memory=141 * 2**30, L2_cache_size=60 * 2**20, max_threads_per_multi_processor=2048,
        warp_size=32, regs_per_multiprocessor=65536, shared_memory_per_block_optin=TARGETS[90],
        shared_memory_per_multiprocessor=228 * 1024, uuid="fake", is_integrated=False,
    )


class _AutocastForCuda(torch.amp.autocast):
    """``torch.autocast("cuda", ...)`` as CPU autocast (which casts the CPU tensors the model really runs on)."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__(_to_cpu_device(device_type), *args, **kwargs)


@contextlib.contextmanager
def _patched(obj, name: str, value) -> Iterator[None]:
    missing = object()
    old = obj.__dict__.get(name, missing) if isinstance(obj, type) else getattr(obj, name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


@contextlib.contextmanager
def fake_cuda(sm_count: int = SM_COUNT) -> Iterator[None]:
    """Run torch code on the CPU while it believes it runs on ``cuda:0`` (see the module docstring).

    Only for the recording process: it patches ``torch.Tensor.device`` / ``is_cuda``, ``torch.cuda``'s
    device queries, streams and guards, and the autocast entry points, and restores them on exit.
    """
    props = _device_properties(sm_count)
    cuda = torch.cuda
    is_autocast_enabled, get_autocast_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    set_autocast_enabled = torch.set_autocast_enabled
    patches = [
        (torch.Tensor, "device", property(lambda self: _CUDA0)),
        (torch.Tensor, "is_cuda", property(lambda self: True)),
        (cuda, "is_available", lambda: True),
        (cuda, "device_count", lambda: 1),
        (cuda, "current_device", lambda: 0),
        (cuda, "set_device", lambda device: None),
        (cuda, "get_device_properties", lambda device=None: props),
        (cuda, "get_device_capability", lambda device=None: (9, 0)),
        (cuda, "get_device_name", lambda device=None: props.name),
        (cuda, "is_bf16_supported", lambda *a, **k: True),
        (cuda, "device", _NullContext),
        (cuda, "device_of", _NullContext),
        (cuda, "stream", _NullContext),
        (cuda, "Stream", _FakeStream),
        (cuda, "current_stream", lambda device=None: _FakeStream()),
        (cuda, "default_stream", lambda device=None: _FakeStream()),
        (cuda, "synchronize", lambda device=None: None),
        (cuda, "is_current_stream_capturing", lambda: False),
        (cuda, "memory_allocated", lambda device=None: 0),
        (cuda, "max_memory_allocated", lambda device=None: 0),
        (cuda, "reset_peak_memory_stats", lambda device=None: None),
        (cuda, "empty_cache", lambda: None),
        (torch, "autocast", _AutocastForCuda),
        (torch.amp, "autocast", _AutocastForCuda),
        (torch, "is_autocast_enabled", lambda device_type="cpu": is_autocast_enabled(_to_cpu_device(device_type))),
        (torch, "get_autocast_dtype", lambda device_type: get_autocast_dtype(_to_cpu_device(device_type))),
        (torch, "set_autocast_enabled", lambda device_type, enabled: set_autocast_enabled(
            _to_cpu_device(device_type), enabled)),
    ]
    with contextlib.ExitStack() as stack:
        for obj, name, value in patches:
            stack.enter_context(_patched(obj, name, value))
        stack.enter_context(_CpuForCuda())
        yield


# ------------------------------------------------------------------------------------------------
# Recording launches at the Triton runtime boundary
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    """One kernel launch: which kernel, how Triton specialised it, with what options and grid."""

    case: str
    kernel: str  # "module:qualname" of the @triton.jit function
    signature: dict  # parameter -> Triton type ("*bf16", "i32", "fp32", "constexpr", ...)
    constexprs: list  # [[path, value], ...] (path: the parameter's index, as a list)
    attrs: list  # [[path, [[attribute, value], ...]], ...] (e.g. tt.divisibility 16)
    options: dict  # the launch's compile options (num_warps, num_stages, ...)
    grid: list

    def spec_key(self) -> str:
        """Identity of the compiled object: same key, same binary (the case and grid do not matter)."""
        blob = json.dumps([self.kernel, self.signature, self.constexprs, self.attrs, self.options], sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """The specialisation in one line: tensor arguments by dtype, integer specialisations, constexprs, options.

        e.g. ``_moda_fwd_kernel(*fp32: q k o lse | *bf16: v | i32%16: T S D | i32==1: s_qd | BLOCK_T=16 ...)``
        """
        names = list(self.signature)
        divisible = {names[path[0]] for path, attrs in self.attrs
                     if len(path) == 1 and any(a[0] == "tt.divisibility" for a in attrs)}
        groups: dict[str, list[str]] = {}
        for name, kind in self.signature.items():
            if kind.startswith("*"):
                groups.setdefault(kind, []).append(name)
            elif kind != "constexpr" and name in divisible:
                groups.setdefault(f"{kind}%16", []).append(name)
        consts = [(names[p[0]], v) for p, v in self.constexprs if len(p) == 1 and p[0] < len(names)]
        ones = [n for n, v in consts if v == 1 and self.signature[n] != "constexpr"]
        parts = [f"{kind}: {' '.join(group)}" for kind, group in groups.items()]
        if ones:
            parts.append(f"==1: {' '.join(ones)}")
        parts.append(" ".join(f"{n}={v}" for n, v in consts if self.signature[n] == "constexpr"))
        opts = " ".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.kernel.split(':')[-1]}({' | '.join(parts)})" + (f" [{opts}]" if opts else "")


class _FakeTritonDriver:
    """The one device Triton's launcher asks about while recording: sm_90, stream 0, no launches."""

    def __init__(self, capability: int = 90, sm_count: int = SM_COUNT):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)
        self.utils = types.SimpleNamespace(get_device_properties=lambda device: {
            "multiprocessor_count": sm_count, "max_shared_mem": TARGETS[capability], "max_num_regs": 65536,
            "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 3201000, "mem_bus_width": 6144,
        })

    def is_active(self):
        return True

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return _CUDA0

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise RuntimeError("the AOT harness runs no kernel: nothing to benchmark")

    def get_empty_cache_for_benchmark(self):
        raise RuntimeError("the AOT harness runs no kernel: nothing to benchmark")


_CURRENT = contextvars.ContextVar("aot_current_launch", default=None)


def _decode_specialization(data: dict) -> tuple[dict, list, list]:
    """``(signature, constexprs, attrs)`` from Triton's serialised specialisation data (JSON lists)."""
    constexprs = []
    for key, value in zip(data["constant_keys"], data["constant_vals"]):
        if isinstance(value, dict) and "constexpr" in value:
            value = value["constexpr"]
        elif isinstance(value, dict) and "jit_function" in value:
            value = {"jit_function": value["jit_function"]}
        constexprs.append([list(key), value])
    attrs = [[list(k), v] for k, v in zip(data["attrs_keys"], data["attrs_vals"])]
    return dict(data["signature"]), constexprs, attrs


@contextlib.contextmanager
def record_launches(case: str, into: list[Launch]) -> Iterator[None]:
    """Append every kernel launch made inside to ``into``, skipping its compilation and execution."""
    import triton
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    original_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = [p.name for p in self.params]
        options = {k: v for k, v in kwargs.items() if k not in params}
        if callable(grid):
            bound = inspect.signature(self.fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
            grid = grid(dict(bound.arguments))
        token = _CURRENT.set((self, options, [int(g) for g in grid]))
        try:
            return original_run(self, *args, grid=grid, warmup=True, **kwargs)
        finally:
            _CURRENT.reset(token)

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        jit_fn, options, grid = _CURRENT.get()
        signature, constexprs, attrs = _decode_specialization(json.loads(compile["specialization_data"]))
        into.append(Launch(case, f"{jit_fn.fn.__module__}:{jit_fn.fn.__qualname__}", signature, constexprs,
                           attrs, options, grid))
        return True  # skip the compile: _do_compile returns None and the launch with it

    from triton.runtime.autotuner import Autotuner

    original_autotune = Autotuner.run

    def autotune(self, *args, **kwargs):
        """An autotuned kernel: every config is a specialisation a GPU may pick (none can be timed here)."""
        for config in self.configs:
            self.fn.run(*args, **kwargs, **config.all_kwargs())

    previous_hook, previous_driver = triton.knobs.runtime.jit_cache_hook, driver._active
    driver.set_active(_FakeTritonDriver())
    triton.knobs.runtime.jit_cache_hook = hook
    JITFunction.run = run
    Autotuner.run = autotune
    try:
        yield
    finally:
        Autotuner.run = original_autotune
        JITFunction.run = original_run
        triton.knobs.runtime.jit_cache_hook = previous_hook
        driver._active = previous_driver


# ------------------------------------------------------------------------------------------------
# Compiling a recorded specialisation
# ------------------------------------------------------------------------------------------------


def _resolve_kernel(name: str):
    """The ``JITFunction`` named ``module:qualname`` (unwrapping ``triton.autotune`` / ``triton.heuristics``)."""
    from triton.runtime.jit import JITFunction

    module, qualname = name.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    return obj


_PTXAS_PROPERTIES = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")


def _ptxas_usage(log: str) -> dict:
    """Registers, stack frame and spill bytes from ``ptxas -v`` output (the kernel's entry function)."""
    props, regs = _PTXAS_PROPERTIES.search(log), _PTXAS_REGISTERS.search(log)
    if props is None or regs is None:
        raise RuntimeError(f"no ptxas resource usage in the compile log (cached compile?): {log[-400:]!r}")
    stack, stores, loads = (int(g) for g in props.groups())
    return {"registers": int(regs.group(1)), "stack": stack, "spill_stores": stores, "spill_loads": loads}


def error_message(exc: BaseException, limit: int = 4000) -> str:
    """The root cause first (Triton wraps it: ``CompilationError`` at each call site, the reason in ``__cause__``),
    then each wrapping error's first line (the kernel source locations), outermost last."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    parts = [f"{type(root).__name__}: {str(root).strip()}"]
    for e in chain[-2::-1]:
        lines = str(e).rstrip().splitlines()
        where = lines[0].strip() if lines else ""
        if len(lines) >= 2 and lines[-1].strip() == "^":  # Triton marks the column under the source line
            where += " " + lines[-2].strip()
        parts.append(f"{type(e).__name__}: {where}")
    if len(chain) == 1 and isinstance(exc, Exception) and "\n" in str(exc):  # one error: keep its text whole
        parts = [f"{type(exc).__name__}: {str(exc).strip()}"]
    return " | ".join(parts)[:limit]


def compile_launch(launch: Launch, capability: int) -> dict:
    """Compile one specialisation for ``sm_<capability>``: registers, spills, shared memory, or the error.

    Needs a fresh ``TRITON_CACHE_DIR`` (a cached compile does not run ptxas, whose log gives the spills).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_launch needs real JIT functions: TRITON_INTERPRET must be unset")
    fn = _resolve_kernel(launch.kernel)
    constexprs = {}
    for path, value in launch.constexprs:
        if isinstance(value, dict) and "jit_function" in value:
            value = _resolve_kernel(value["jit_function"])
        constexprs[tuple(path)] = value
    attrs = {tuple(path): [tuple(a) for a in value] for path, value in launch.attrs}
    src = ASTSource(fn, dict(launch.signature), constexprs, attrs)
    result = {"target": f"sm_{capability}", "triton": triton.__version__}
    t0 = time.perf_counter()
    log = io.StringIO()
    triton.knobs.nvidia.dump_ptxas_log = True  # printed to stdout by the compile: captured below
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(launch.options))
        result.update(ok=True, shared=int(compiled.metadata.shared), num_warps=int(compiled.metadata.num_warps),
                      num_stages=int(compiled.metadata.num_stages), **_ptxas_usage(log.getvalue()))
    except Exception as exc:  # noqa: BLE001 - the error is the result
        result.update(ok=False, error=error_message(exc))
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def is_half(launch: Launch) -> bool:
    """A bf16 / fp16 configuration: some tensor argument is bf16 or fp16 (mixed ones included)."""
    return any(t in HALF_TYPES for t in launch.signature.values())


def problems(launch: Launch, result: dict) -> list[str]:
    """What is wrong with a compiled specialisation (empty when nothing is)."""
    if not result["ok"]:
        return [f"does not compile: {result['error']}"]
    found = []
    limit = TARGETS[int(result["target"].removeprefix("sm_"))]
    if result["shared"] > limit:
        found.append(f"shared memory {result['shared']} B > the {result['target']} limit {limit} B")
    if is_half(launch) and (result["spill_stores"] or result["spill_loads"]):
        found.append(f"bf16/fp16 configuration spills registers ({result['spill_stores']} B stores, "
                     f"{result['spill_loads']} B loads, {result['registers']} registers)")
    over = [f"grid[{i}]={g} > {lim}" for i, (g, lim) in enumerate(zip(launch.grid, GRID_LIMITS)) if g > lim]
    if over:
        found.append("grid past CUDA's limits: " + ", ".join(over))
    return found


# ------------------------------------------------------------------------------------------------
# Cases: how a user reaches the kernels (public ops and model forwards only)
# ------------------------------------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Case:
    """One way of reaching the kernels; ``ci`` marks the covering subset the CI test compiles."""

    name: str
    run: Callable[[], None]
    ci: bool = False


def _empty(*shape: int, dtype: torch.dtype, grad: bool = True) -> torch.Tensor:
    """An uninitialised "CUDA" tensor (no kernel runs, so no value is ever read)."""
    return torch.empty(shape, dtype=dtype, device="cuda").requires_grad_(grad)


@contextlib.contextmanager
def _precision(mode: str) -> Iterator[torch.dtype]:
    """``mode`` is a dtype name (inputs of that dtype) or ``autocast-<dtype>`` (fp32 inputs under autocast)."""
    if mode.startswith("autocast-"):
        with torch.autocast("cuda", dtype=DTYPES[mode.removeprefix("autocast-")]):
            yield torch.float32
    else:
        yield DTYPES[mode]


def _dwa_op(mode: str, shape: tuple[int, ...], n_src: int) -> Callable[[], None]:
    def run():
        from depthfusion_hf.ops import depth_weighted_average

        with _precision(mode) as dtype:
            sources = [_empty(*shape, dtype=dtype) for _ in range(n_src)]
            out = depth_weighted_average(sources, _empty(n_src, dtype=dtype), backend="triton")
        backward(out)
    return run


def _attnres_op(mode: str, shape: tuple[int, ...], n_src: int, mixed: bool = False) -> Callable[[], None]:
    """``mixed``: the embedding source fp32 and the rest in ``mode``'s dtype (what a model gives under autocast)."""
    def run():
        from depthfusion_hf.ops import attention_residual

        with _precision(mode) as dtype:
            dim = shape[-1]
            sources = [_empty(*shape, dtype=torch.float32 if mixed and i == 0 else dtype) for i in range(n_src)]
            h, alpha = attention_residual(_empty(dim, dtype=torch.float32), sources, _empty(dim, dtype=torch.float32),
                                          return_weights=True, backend="triton")
        backward([h, alpha])
    return run


def _moda_op(mode: str, head_dim: int, groups: int, seq: int, depth: int, *, past: int = 0, mask: bool = False,
             mixed: bool = False, batch: int = 2, kv_heads: int = 2) -> Callable[[], None]:
    """q [B, Hkv*G, T, d] against S = past + T keys and M = ``depth`` entries per token. ``mixed``: q and k fp32,
    v and the depth entries in ``mode``'s dtype (RoPE's promotion under autocast); ``mask``: left padding."""
    def run():
        from depthfusion_hf.ops import moda_attention

        with _precision(mode) as dtype:
            qk, rest = (torch.float32, DTYPES[mode.removeprefix("autocast-")]) if mixed else (dtype, dtype)
            kv_len = past + seq
            q = _empty(batch, kv_heads * groups, seq, head_dim, dtype=qk)
            k = _empty(batch, kv_heads, kv_len, head_dim, dtype=qk)
            v = _empty(batch, kv_heads, kv_len, head_dim, dtype=rest)
            depth_k = _empty(batch, kv_heads, seq, depth, head_dim, dtype=rest)
            depth_v = _empty(batch, kv_heads, seq, depth, head_dim, dtype=rest)
            attention_mask = None
            if mask:
                attention_mask = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool, device="cuda")
                attention_mask[0, ..., : kv_len // 4] = False
            out = moda_attention(q, k, v, depth_k, depth_v, attention_mask=attention_mask, backend="triton")
        backward(out)
    return run


def _mhc_op(mode: str, shape: tuple[int, int, int, int], which: str) -> Callable[[], None]:
    """mHC's ops on streams [B, T, n, D]: ``connection`` (weights + collapse), ``head`` or ``mix``; parameters fp32
    (a model's under autocast), the streams in ``mode``'s dtype."""
    def run():
        from depthfusion_hf.models.mhc_connection import hyper_connection, hyper_head
        from depthfusion_hf.models.mhc_mix import hyper_mix

        with _precision(mode) as dtype:
            batch, seq, n, dim = shape
            streams = _empty(batch, seq, n, dim, dtype=dtype)
            if which == "mix":
                post, comb = _empty(batch, seq, n, dtype=torch.float32), _empty(batch, seq, n, n, dtype=torch.float32)
                out = hyper_mix(streams, _empty(batch, seq, dim, dtype=dtype), post, comb, backend="triton")
            elif which == "head":
                out = hyper_head(streams, _empty(n, n * dim, dtype=torch.float32), _empty(n, dtype=torch.float32),
                                 _empty(1, dtype=torch.float32), eps=1e-6, norm_eps=1e-6, backend="triton")
            else:
                rows = (2 + n) * n
                out = hyper_connection(streams, _empty(rows, n * dim, dtype=torch.float32),
                                       _empty(rows, dtype=torch.float32), _empty(3, dtype=torch.float32),
                                       sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6, backend="triton")
        backward(out)
    return run


# Model shapes: realistic head dims and GQA at a width that runs fast on the CPU (the kernels never run).
_DECODER = dict(vocab_size=512, intermediate_size=1024, num_hidden_layers=4, max_position_embeddings=4096,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
_HEADS = {64: dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64),
          128: dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128)}


def _model(family: str, head_dim: int, mode: str):
    import depthfusion_hf as dfh

    kwargs = {**_DECODER, **_HEADS[head_dim]}
    if family == "denseformer":
        config = dfh.DenseFormerConfig(**kwargs, dwa_dilation=2, dwa_period=1)
    elif family == "moda":
        config = dfh.MoDAConfig(**kwargs)
    elif family == "moda-gated":  # the depth gate's kernel variant (an upcycled model's)
        config = dfh.MoDAConfig(**kwargs, moda_depth_gate=True, moda_depth_gate_init=0.5)
    elif family == "attnres-block":
        config = dfh.AttnResConfig(**kwargs, attnres_block_size=2)
    elif family == "attnres-full":
        config = dfh.AttnResConfig(**kwargs)
    elif family == "mhc":  # not in the family registry yet: its classes directly
        from depthfusion_hf.models.configuration_mhc import MHCConfig
        from depthfusion_hf.models.modeling_mhc import MHCForCausalLM

        dtype = torch.float32 if mode.startswith("autocast-") else DTYPES[mode]
        return "mhc", MHCForCausalLM(MHCConfig(**kwargs)).to("cuda", dtype)
    else:
        raise ValueError(f"unknown family {family!r}")
    dtype = torch.float32 if mode.startswith("autocast-") else DTYPES[mode]
    return config.model_type, dfh.get_family(config.model_type).task_model_class(config).to("cuda", dtype)


def _model_train(family: str, head_dim: int, mode: str, seq: int = 256) -> Callable[[], None]:
    """One training step: a left-padded batch of 2 with labels, forward + backward."""
    def run():
        _, model = _model(family, head_dim, mode)
        ids = torch.randint(3, _DECODER["vocab_size"], (2, seq), device="cuda")
        mask = torch.ones_like(ids)
        mask[0, : seq // 4] = 0
        with _precision(mode):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        backward(loss)
    return run


def _model_generate(family: str, head_dim: int, mode: str, prompt: int = 33) -> Callable[[], None]:
    """Greedy decoding of 3 tokens after a left-padded prompt, with the default cache (prefill + decode steps)."""
    def run():
        _, model = _model(family, head_dim, mode)
        model.eval()
        ids = torch.randint(3, _DECODER["vocab_size"], (2, prompt), device="cuda")
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        with torch.no_grad(), _precision(mode):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           pad_token_id=0)
    return run


# The covering subset CI compiles (about 8 minutes on 2 cores): every kernel in every dtype it is launched with,
# the tile choices of head dims 64 / 128 / 256, GQA 1 (MoDA's per-entry depth form) and 2 (its dot form), padded,
# odd and decoding shapes, the mixed dtypes autocast gives, and each family's model step. fp32 MoDA compiles
# slowest (IEEE dots, tens of seconds each): CI keeps one fp32 MoDA shape.
CI_CASES = frozenset({
    "dwa/op/fp32/train", "dwa/op/bf16/train", "dwa/op/fp16/train", "dwa/op/bf16/odd",
    "attnres/op/fp32/D1024/train", "attnres/op/bf16/D1024/train", "attnres/op/fp16/D1024/train",
    "attnres/op/bf16/D4096/train", "attnres/op/bf16/decode", "attnres/op/autocast-bf16/mixed-sources",
    "moda/op/fp32/d128/G2/train", "moda/op/fp16/d128/G2/train", "moda/op/bf16/d64/G2/train",
    "moda/op/bf16/d128/G2/train", "moda/op/bf16/d256/G2/train", "moda/op/bf16/d128/G1/train",
    "moda/op/bf16/d128/G2/padded-odd", "moda/op/bf16/d128/G2/decode", "moda/op/autocast-bf16/d128/G2/train",
    "moda/op/autocast-bf16/d128/G2/mixed-rope",
    "denseformer/model/bf16/d128/train", "denseformer/model/bf16/d128/generate",
    "denseformer/model/autocast-bf16/d128/train",
    "moda/model/bf16/d128/train", "moda/model/bf16/d128/generate", "moda/model/autocast-bf16/d128/train",
    "moda-gated/model/bf16/d128/train",
    "attnres-block/model/bf16/d128/train", "attnres-block/model/bf16/d128/generate",
    "attnres-block/model/autocast-bf16/d128/train", "attnres-full/model/bf16/d128/train",
    "attnres-full/model/autocast-bf16/d128/train",
    "mhc/op/fp32/D1024/connection", "mhc/op/bf16/D1024/connection", "mhc/op/fp16/D1024/connection",
    "mhc/op/bf16/D4096/connection", "mhc/op/bf16/D1024/head", "mhc/op/bf16/D1024/mix", "mhc/op/fp32/D1024/mix",
    "mhc/op/bf16/decode/connection", "mhc/model/bf16/d128/train", "mhc/model/autocast-bf16/d128/train",
    "mhc/model/bf16/d128/generate",
})


def _build_cases() -> dict[str, Case]:
    """Every case the sweep compiles. MoDA's full tile grid (d 64 / 128 / 256 x G 1 / 2 / 4 / 8) in bf16; fp16 and
    fp32 at the shapes whose tiles differ (their compiles are the same code in another dtype, fp32's the slowest)."""
    cases: list[Case] = []
    add = lambda name, run: cases.append(Case(name, run, name in CI_CASES))  # noqa: E731
    moda_grid = {"bf16": [(d, g) for d in (64, 128, 256) for g in (1, 2, 4, 8)],
                 "fp16": [(128, 1), (128, 2), (64, 2), (256, 2)], "fp32": [(64, 2), (128, 1), (128, 2)]}
    for dt in ("fp32", "bf16", "fp16"):
        add(f"dwa/op/{dt}/train", _dwa_op(dt, (2, 2048, 1024), 9))
        add(f"dwa/op/{dt}/odd", _dwa_op(dt, (1, 7, 1000), 5))
        for dim in (1024, 2048, 4096):
            add(f"attnres/op/{dt}/D{dim}/train", _attnres_op(dt, (2, 2048, dim), 9))
        add(f"attnres/op/{dt}/decode", _attnres_op(dt, (4, 1, 2048), 9))
        for head_dim, groups in moda_grid[dt]:
            add(f"moda/op/{dt}/d{head_dim}/G{groups}/train", _moda_op(dt, head_dim, groups, 2048, 8))
        for head_dim in (64, 128, 256) if dt == "bf16" else (128,):
            add(f"moda/op/{dt}/d{head_dim}/G2/padded-odd", _moda_op(dt, head_dim, 2, 1023, 24, mask=True))
            add(f"moda/op/{dt}/d{head_dim}/G2/decode", _moda_op(dt, head_dim, 2, 1, 24, past=2047))
    for dt in ("bf16", "fp16"):
        add(f"dwa/op/autocast-{dt}/train", _dwa_op(f"autocast-{dt}", (2, 2048, 1024), 9))
        add(f"attnres/op/autocast-{dt}/mixed-sources", _attnres_op(dt, (2, 2048, 1024), 9, mixed=True))
        for head_dim in (64, 128):
            add(f"moda/op/autocast-{dt}/d{head_dim}/G2/train", _moda_op(f"autocast-{dt}", head_dim, 2, 2048, 8))
            add(f"moda/op/autocast-{dt}/d{head_dim}/G2/mixed-rope",
                _moda_op(f"autocast-{dt}", head_dim, 2, 2048, 8, mixed=True))
    for dt in ("fp32", "bf16", "fp16"):
        for dim in (1024, 4096):
            for which in ("connection", "head", "mix"):
                add(f"mhc/op/{dt}/D{dim}/{which}", _mhc_op(dt, (2, 2048, 4, dim), which))
        add(f"mhc/op/{dt}/decode/connection", _mhc_op(dt, (4, 1, 4, 2048), "connection"))
    # models: bf16 weights and bf16 autocast at both head dims; fp32 and fp16 autocast at d 128 (training only)
    for family in ("denseformer", "moda", "moda-gated", "attnres-block", "attnres-full", "mhc"):
        for head_dim in (64, 128):
            for mode in ("bf16", "autocast-bf16"):
                add(f"{family}/model/{mode}/d{head_dim}/train", _model_train(family, head_dim, mode))
                add(f"{family}/model/{mode}/d{head_dim}/generate", _model_generate(family, head_dim, mode))
        for mode in ("fp32", "autocast-fp16"):
            add(f"{family}/model/{mode}/d128/train", _model_train(family, 128, mode))
    unknown = CI_CASES - {case.name for case in cases}
    if unknown:
        raise RuntimeError(f"CI_CASES names cases that do not exist: {sorted(unknown)}")
    return {case.name: case for case in cases}


CASES = _build_cases()


# ------------------------------------------------------------------------------------------------
# The two phases as commands, and running both from another process
# ------------------------------------------------------------------------------------------------


def record(names: list[str]) -> tuple[list[Launch], dict[str, str]]:
    """Drive each named case under :func:`fake_cuda`; the launches and, per case that raised, its error."""
    launches: list[Launch] = []
    errors: dict[str, str] = {}
    for name in names:
        torch.manual_seed(0)
        try:
            with fake_cuda(), record_launches(name, launches):
                CASES[name].run()
        except Exception as exc:  # noqa: BLE001 - reported per case
            errors[name] = f"{type(exc).__name__}: {exc}"[:2000]
    return launches, errors


def _compile_one(job: tuple[dict, int]) -> dict:
    launch, capability = job
    return compile_launch(Launch(**launch), capability)


def compile_all(launches: list[Launch], capabilities: list[int], jobs: int) -> dict[tuple[str, int], dict]:
    """Compile each distinct specialisation once per target, ``jobs`` processes at a time."""
    unique = {}
    for launch in launches:
        unique.setdefault(launch.spec_key(), launch)
    work = [(key, cc) for key in unique for cc in capabilities]
    # the slowest first (MoDA before the memory-bound kernels), so that the pool ends together
    work.sort(key=lambda item: ("moda" not in unique[item[0]].kernel, item))
    payload = [(dataclasses.asdict(unique[key]), cc) for key, cc in work]
    if jobs <= 1:
        results = map(_compile_one, payload)
    else:
        pool = ProcessPoolExecutor(max_workers=jobs)
        results = pool.map(_compile_one, payload)
    return dict(zip(work, results))


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="ci", help="'ci', 'all', or comma-separated case names / prefixes")
    parser.add_argument("--targets", default="80,90", help="compute capabilities, comma-separated")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines: one per case, launch and compile")
    parser.add_argument("--list", action="store_true", help="print the selected case names and exit")
    args = parser.parse_args(argv)
    names = select_cases(args.cases)
    if args.list:
        print("\n".join(names))
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: the harness needs real JIT functions")
    t0 = time.perf_counter()
    launches, errors = record(names)
    t_record = time.perf_counter() - t0
    results = compile_all(launches, [int(c) for c in args.targets.split(",")], args.jobs)
    with args.out.open("w") as out:
        for name in names:
            out.write(json.dumps({"kind": "case", "case": name, "error": errors.get(name),
                                  "launches": sum(1 for launch in launches if launch.case == name)}) + "\n")
        for launch in launches:
            out.write(json.dumps({"kind": "launch", **dataclasses.asdict(launch), "spec": launch.spec_key()}) + "\n")
        for (key, cc), result in results.items():
            out.write(json.dumps({"kind": "compile", "spec": key, "capability": cc, **result}) + "\n")
        out.write(json.dumps({"kind": "timing", "record_s": round(t_record, 1),
                              "total_s": round(time.perf_counter() - t0, 1)}) + "\n")
    return 0


def select_cases(selection: str) -> list[str]:
    """``ci`` (the covering subset), ``all``, or comma-separated names / name prefixes."""
    if selection == "ci":
        return [name for name, case in CASES.items() if case.ci]
    if selection == "all":
        return list(CASES)
    names = []
    for part in selection.split(","):
        matched = [name for name in CASES if name == part or name.startswith(part.rstrip("/") + "/")]
        if not matched:
            raise SystemExit(f"no case matches {part!r}")
        names += [name for name in matched if name not in names]
    return names


@dataclasses.dataclass
class Run:
    """A finished harness run read back: per-case errors and launches, compile results per (spec, capability)."""

    case_errors: dict[str, str | None]
    launches: list[Launch]
    results: dict[tuple[str, int], dict]
    timing: dict

    @classmethod
    def read(cls, path: Path) -> Run:
        case_errors, launches, results, timing = {}, [], {}, {}
        for line in path.read_text().splitlines():
            row = json.loads(line)
            kind = row.pop("kind")
            if kind == "case":
                case_errors[row["case"]] = row["error"]
            elif kind == "launch":
                row.pop("spec")
                launches.append(Launch(**row))
            elif kind == "compile":
                results[(row.pop("spec"), row.pop("capability"))] = row
            else:
                timing = row
        return cls(case_errors, launches, results, timing)

    def failures(self, case: str, capability: int) -> list[str]:
        """Every problem of the case on that target, each naming the kernel and its specialisation."""
        if self.case_errors.get(case):
            return [f"driving the case raised {self.case_errors[case]}"]
        found, seen = [], set()
        for launch in (launch for launch in self.launches if launch.case == case):
            key = launch.spec_key()
            for problem in problems(launch, self.results[(key, capability)]):
                if (key, problem) not in seen:
                    seen.add((key, problem))
                    found.append(f"{launch.describe()} grid={launch.grid}: {problem}")
        return found


def run_harness(cases: str, out: Path, targets: str = "80,90", jobs: int = 2, timeout: float = 3600,
                python: str = sys.executable) -> Run:
    """Record and compile in a fresh process (fresh Triton cache, no ``TRITON_INTERPRET``) and read the result."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEPTHFUSION_BACKEND")}
    cache = out.parent / (out.stem + "-triton-cache")
    env.update(TRITON_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT), str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRITON_DEFAULT_FP_FUSION=env.get("TRITON_DEFAULT_FP_FUSION", "1"))
    cmd = [python, "-m", "tests.kernels.aot", "--cases", cases, "--targets", targets, "--jobs", str(jobs),
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the AOT harness failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return Run.read(out)


if __name__ == "__main__":
    sys.exit(_main())
