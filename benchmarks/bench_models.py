#!/usr/bin/env python
"""Training-step time, peak memory and decode tokens/s of every family against the same-shape Llama, in one run.

Every model gets the same Llama configuration (default: 12 layers, hidden 256, 4 heads × 64, SwiGLU 704, vocab
8192, seq 256, batch 4, fp32, SDPA attention; the models and their names: ``model_zoo.py``) and is measured with
interleaved repeats (the harness: ``harness.py``), so machine load hits all of them alike:

- train step: forward with labels + backward + AdamW step + zero_grad (``--compile``: of ``torch.compile(model)``);
- peak memory: bytes allocated during one train step above what was allocated before it;
- decode: ``generate`` with the dynamic KV cache, greedy, batch 1, a 32-token prompt, 64 new tokens (eager);
- ``--decode-compile`` (issue 21): also ``generate(..., cache_implementation="static")`` eager, and the same with
  the decoding step compiled the way transformers does it (the generation config's ``compile_config``:
  ``torch.compile(model.__call__, fullgraph=True)``, mode ``default`` on CPU, ``reduce-overhead`` (CUDA graphs) on
  CUDA; on CPU transformers compiles only when ``compile_config._compile_all_devices`` is set, which this does).
  The first compiled call is the compilation (its seconds are reported); a second must not recompile
  (``torch.compiler.set_stance("fail_on_recompile")``), and its tokens must equal the eager static-cache ones. A
  model that cannot be captured whole or recompiles is reported as such, with the error, not timed.

Ratios are against transformers' ``LlamaForCausalLM`` measured in the same interleave: the median over repeats of
the paired ratio (repeat i of a model ÷ repeat i of Llama), with its [min, max]; ``llama-control``, a second
identical Llama, gives the run's noise. Time is process CPU time on CPU (the cores are shared), wall time on CUDA.

``--before <checkout>`` (a checkout, or one of its ``models/<family>`` folders) imports every family folder of
that checkout under another package name (``denseformer_before``, ``moda_before``, ``attnres_before``); its models
are ``<name>-before`` (``attnres-block8-before``), measured in the same interleave, and each current model is also
reported against its ``-before`` (new ÷ old, paired). Before timing, each pair that computes the same function
(a model and its ``-before``, a ``-ckpt`` model and the same without checkpointing) is checked on fresh float64
copies with the same perturbed weights: loss and every parameter gradient equal to ``CHECK_GATE`` relative (float64
rounding; a real difference is many orders larger); a pair whose parameters differ is reported as not compared.

Bounds (ratios vs Llama, CPU; :data:`TARGETS`): issue 18: AttnRes block-8 train ≤ 1.12, full ≤ 1.20, decode ≥ 0.82;
MoDA train ≤ 1.30, peak ≤ 1.25, decode ≥ 0.80; DenseFormer unchanged against ``-before`` within the run's noise
(the largest deviation of ``llama-control`` from 1), its issue-5 bounds (4×5 train ≤ 1.03, 1×1 ≤ 1.10, decode ≥
0.95) shown as context. Issue 21, compiled static-cache decode: DenseFormer and AttnRes ≥ 0.95, MoDA ≥ 0.90. A miss
is printed as MISSED. ``--profile`` prints each model's top operators of a train step. Results are appended to
``docs/bench/models.jsonl``.

    python benchmarks/bench_models.py                                   # CPU, fp32, 1 thread, every model
    python benchmarks/bench_models.py --models llama,llama-control,attnres-full,attnres-block8 --before /work/before
    python benchmarks/bench_models.py --models llama,denseformer-4x5,attnres-block8,moda --decode-compile
    python benchmarks/bench_models.py --device cuda --dtype bf16 --batch 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BENCH_DIR,
    DTYPES,
    Spread,
    append_record,
    interleave,
    load_before_families,
    meets,
    paired,
    peak_memory_bytes,
    print_header,
    record_header,
    time_call,
)
from model_zoo import builder, common_fields, default_names, parse_name, same_function_pairs  # noqa: E402

from depthfusion_hf.families import causal_lm_families  # noqa: E402
from depthfusion_hf.models.backbones import BACKBONES  # noqa: E402

# Ratios against Llama: train and peak ≤ bound, decode speeds ≥ bound (issue 18; decode_compiled: issue 21).
TARGETS = {
    "denseformer-1x1": {"decode_compiled": 0.95},
    "denseformer-4x5": {"decode_compiled": 0.95},
    "attnres-full": {"train": 1.20, "decode": 0.82, "decode_compiled": 0.95},
    "attnres-block8": {"train": 1.12, "decode": 0.82, "decode_compiled": 0.95},
    "moda": {"train": 1.30, "peak": 1.25, "decode": 0.80, "decode_compiled": 0.90},
    "moda-noffn": {"train": 1.30, "peak": 1.25, "decode": 0.80, "decode_compiled": 0.90},
    "mhc": {"train": 1.20, "decode": 0.90},  # issue 22 (n = 4)
}
CONTEXT = {  # issue 5's DenseFormer bounds: printed and recorded, not judged (issue 18 asks for "unchanged")
    "denseformer-4x5": {"train": 1.03, "decode": 0.95},
    "denseformer-1x1": {"train": 1.10, "decode": 0.95},
}
UNCHANGED = ("denseformer-1x1", "denseformer-4x5")  # judged against their -before, within the run's noise
SPEEDS = ("decode", "decode_static", "decode_compiled")  # higher is better
CHECK_GATE = 1e-10  # float64: relative difference of the loss and of each gradient's norm


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--attn", default="sdpa", help="attention implementation for every model")
    p.add_argument("--models", default=None, help="comma list of <base>[-ckpt][-before] (default: all available)")
    p.add_argument("--before", default=None,
                   help="another checkout (or one of its models/<family> folders): its families run as <name>-before")
    p.add_argument("--window", type=int, default=4, help="moda_depth_window of the moda-w<W> model")
    p.add_argument("--backbone", default="llama", choices=list(BACKBONES),
                   help="the decoder every model is built on: 'llama' and 'llama-control' are its own causal LM")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="num_key_value_heads of every model (default: query heads, MHA; half of them: GQA G=2)")
    p.add_argument("--label", default="", help="free text stored with the record (e.g. the sweep name)")
    p.add_argument("--reps", type=int, default=9, help="interleaved train-step repeats")
    p.add_argument("--decode-reps", type=int, default=5)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on shared machines)")
    p.add_argument("--profile", action="store_true", help="print the top operators of each train step")
    p.add_argument("--compile", action="store_true",
                   help="time the train step of torch.compile(model) (inductor) for every model; decode stays eager")
    p.add_argument("--decode-compile", action="store_true",
                   help="also static-cache decode, eager and compiled (issue 21), reported side by side")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode of the decoding step (default: reduce-overhead on CUDA, default on CPU)")
    p.add_argument("--out", default=str(BENCH_DIR / "models.jsonl"))
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# The same-function check
# ---------------------------------------------------------------------------------------------------


def loss_and_gradients(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one forward with labels and every parameter's gradient (float64 model)."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_same_function(builders: dict[str, Callable], pairs: list[tuple[str, str]], batch: dict,
                        device: torch.device) -> dict[str, dict]:
    """Each pair, built afresh in float64 with the same perturbed weights (every parameter + 0.02 N(0, 1), so that
    zero and identity initialisations do not hide a difference), gives the same loss and gradients to
    :data:`CHECK_GATE` relative. Returns the measured errors per pair (``compared: False`` with the reason when the
    two have different parameters). Raises AssertionError naming the first difference beyond the gate."""
    measured = {}
    for a, b in pairs:
        torch.manual_seed(0)
        first = builders[a]().to(device=device, dtype=torch.float64).train()
        second = builders[b]().to(device=device, dtype=torch.float64).train()
        gen = torch.Generator().manual_seed(1)
        state = {k: v + 0.02 * torch.randn(v.shape, generator=gen, dtype=v.dtype).to(device)
                 if v.is_floating_point() else v for k, v in first.state_dict().items()}
        first.load_state_dict(state)
        try:
            second.load_state_dict(state)
        except RuntimeError as error:
            reason = " ".join(str(error).split())[:300]
            measured[f"{a}|{b}"] = dict(compared=False, reason=reason)
            print(f"# same function: {a} vs {b}: not compared, their parameters differ ({reason})")
            continue
        (loss_a, grads_a), (loss_b, grads_b) = loss_and_gradients(first, batch), loss_and_gradients(second, batch)
        loss_err = (abs(loss_a - loss_b) / abs(loss_b)).item()
        assert loss_err <= CHECK_GATE, f"{a} vs {b}: loss differs by {loss_err:.2e} relative (gate {CHECK_GATE:.0e})"
        assert set(grads_a) == set(grads_b), f"{a} vs {b}: gradients of different parameters"
        worst = 0.0
        for n, g in grads_b.items():
            err = ((grads_a[n] - g).norm() / g.norm().clamp_min(1e-300)).item()
            assert err <= CHECK_GATE, f"{a} vs {b}: gradient of {n} differs by {err:.2e} relative"
            worst = max(worst, err)
        measured[f"{a}|{b}"] = dict(compared=True, loss_rel=loss_err, grad_rel_worst=worst, gate=CHECK_GATE)
        print(f"# same function: {a} vs {b}: loss rel {loss_err:.1e}, worst gradient rel {worst:.1e} "
              f"(float64, gate {CHECK_GATE:.0e})")
        del first, second
    return measured


# ---------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------


def make_train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    """One optimiser step; returns the loss tensor."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def step() -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def generate_call(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, **kwargs) -> Callable:
    """Greedy ``generate`` of exactly ``new_tokens`` tokens (eval mode, no grad); returns the sequences."""
    def call() -> torch.Tensor:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 use_cache=True, pad_token_id=0, **kwargs)
        model.train(was_training)
        assert out.shape[1] == prompt.shape[1] + new_tokens
        return out

    return call


def tokens_per_second(times: dict[str, list[float]], tokens: int) -> dict[str, list[float]]:
    """Seconds per call -> generated tokens per second, per repeat."""
    return {name: [tokens / t for t in values] for name, values in times.items()}


def compiled_decode(models: dict[str, torch.nn.Module], prompt: torch.Tensor, args, device: torch.device) -> dict:
    """Static-cache decode, eager and compiled (see the module docstring): per model the tokens/s of each repeat, the
    compile seconds, whether the compiled tokens equal the eager ones, or why it could not be compiled."""
    import torch._dynamo.config as dynamo_config
    from transformers import CompileConfig

    # Every family inherits LlamaForCausalLM.forward: one code object, one compiled entry per model. The default
    # limit (8) would silently send the ninth model back to eager.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 4 * len(models))
    mode = args.compile_mode or ("reduce-overhead" if device.type == "cuda" else "default")
    config = CompileConfig(fullgraph=True, mode=mode)
    if device.type != "cuda":
        config._compile_all_devices = True  # transformers compiles on CPU only when asked (its own tests do this)
    tokens = args.new_tokens * prompt.shape[0]
    eager = {n: generate_call(m, prompt, args.new_tokens, cache_implementation="static", disable_compile=True)
             for n, m in models.items()}
    compiled = {n: generate_call(m, prompt, args.new_tokens, cache_implementation="static", compile_config=config)
                for n, m in models.items()}
    out: dict[str, dict] = {n: {} for n in models}
    for name in models:
        want = eager[name]()
        try:
            out[name]["compile_s"] = time_call(compiled[name], device)  # the first call compiles
            with torch.compiler.set_stance("fail_on_recompile"):
                got = compiled[name]()
        except Exception as error:  # reported, not hidden: the family cannot be compiled whole (yet)
            out[name]["failed"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
            print(f"# compiled decode: {name}: not compiled ({out[name]['failed']})")
            continue
        out[name]["tokens_equal_eager"] = bool(torch.equal(got, want))
    ok = [n for n in models if "failed" not in out[n]]
    static = tokens_per_second(interleave(eager, args.decode_reps, device, warmup=0), tokens)
    with torch.compiler.set_stance("fail_on_recompile"):
        fast = tokens_per_second(interleave({n: compiled[n] for n in ok}, args.decode_reps, device, warmup=0), tokens)
    for name in models:
        out[name]["static_tok_s"] = static[name]
        if name in fast:
            out[name]["compiled_tok_s"] = fast[name]
    return dict(mode=mode, fullgraph=True, models=out)


def profile_step(name: str, step: Callable, rows: int) -> None:
    """Print the top operators of one train step (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"\n--- {name}: top operators of one train step (self CPU time) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


# ---------------------------------------------------------------------------------------------------
# Ratios, verdicts, the table
# ---------------------------------------------------------------------------------------------------


def verdicts_of(name: str, ratios: dict[str, Spread], vs_before: dict[str, Spread], noise: dict[str, float],
                attempted: set[str]) -> list:
    """The verdicts of one model: its bounds (:data:`TARGETS`; a metric of ``attempted`` that could not be measured,
    e.g. a decode that could not be compiled, is a miss), context bounds, and "unchanged" for :data:`UNCHANGED`
    (``|new ÷ before - 1|`` within ``noise``, the largest deviation of ``llama-control``)."""
    out = []
    for metric, bound in TARGETS.get(name, {}).items():
        if metric in ratios:
            value = ratios[metric].median
            out.append(dict(kind="target", metric=metric, bound=bound, value=value,
                            met=meets(value, bound, metric in SPEEDS)))
        elif metric in attempted:
            out.append(dict(kind="target", metric=metric, bound=bound, value=None, met=False))
    for metric, bound in CONTEXT.get(name, {}).items():
        if metric in ratios:
            value = ratios[metric].median
            out.append(dict(kind="context", metric=metric, bound=bound, value=value,
                            met=meets(value, bound, metric in SPEEDS)))
    if name in UNCHANGED:
        for metric in ("train", "decode"):
            if metric in vs_before and metric in noise:
                value = abs(vs_before[metric].median - 1)
                out.append(dict(kind="unchanged", metric=metric, bound=noise[metric], value=value,
                                met=value <= noise[metric]))
    return out


def verdict_text(v: dict) -> str:
    """``"train ≤ 1.12: met"``, ``"decode unchanged (|Δ| 0.8 % ≤ noise 1.5 %): met"``, ``... (context)``."""
    state = "met" if v["met"] else "MISSED"
    if v["value"] is None:
        state += " (not measured)"
    if v["kind"] == "unchanged":
        return f"{v['metric']} vs before |Δ| {v['value']:.1%} ≤ noise {v['bound']:.1%}: {state}"
    sign = "≥" if v["metric"] in SPEEDS else "≤"
    return f"{v['metric']} {sign} {v['bound']}: {state}" + (" (context)" if v["kind"] == "context" else "")


def summarise(names: list[str], n_params: dict, train: dict, peak: dict, decode: dict, compiled: dict | None) -> list:
    """One result per model (the record's ``results``), with paired ratios, ``-before`` ratios and verdicts."""
    base = "llama"
    ratio_of: dict[str, dict[str, Spread]] = {}
    for name in names:
        ratios = {"train": paired(train[name], train[base]), "decode": paired(decode[name], decode[base]),
                  "peak": Spread.of([peak[name] / peak[base]])}
        if compiled is not None:
            runs, llama = compiled["models"][name], compiled["models"][base]
            ratios["decode_static"] = paired(runs["static_tok_s"], llama["static_tok_s"])
            if "compiled_tok_s" in runs and "compiled_tok_s" in llama:
                ratios["decode_compiled"] = paired(runs["compiled_tok_s"], llama["compiled_tok_s"])
        ratio_of[name] = ratios
    noise = {}
    if "llama-control" in ratio_of:
        for metric in ("train", "decode"):
            spread = ratio_of["llama-control"][metric]
            noise[metric] = max(abs(spread.min - 1), abs(spread.max - 1))
    results = []
    for name in names:
        t_med, d_med = statistics.median(train[name]) * 1e3, statistics.median(decode[name])
        result = dict(
            model=name, params=n_params[name], train_ms_min=min(train[name]) * 1e3, train_ms_median=t_med,
            train_s_all=train[name], peak_mib=peak[name], decode_tok_s_best=max(decode[name]),
            decode_tok_s_median=d_med, decode_all=decode[name],
            train_ratio=min(train[name]) / min(train[base]),
            train_ratio_median=t_med / (statistics.median(train[base]) * 1e3),
            train_ratio_paired_median=ratio_of[name]["train"].median,
            train_ratio_paired_all=list(ratio_of[name]["train"].values), peak_ratio=ratio_of[name]["peak"].median,
            decode_ratio=max(decode[name]) / max(decode[base]),
            decode_ratio_median=d_med / statistics.median(decode[base]),
            decode_ratio_paired_median=ratio_of[name]["decode"].median,
            decode_ratio_paired_all=list(ratio_of[name]["decode"].values),
            ratios={metric: spread.as_record() for metric, spread in ratio_of[name].items()},
        )
        vs_before = {}
        if f"{name}-before" in ratio_of:
            other = f"{name}-before"
            vs_before = {"train": paired(train[name], train[other]), "decode": paired(decode[name], decode[other])}
            result["vs_before"] = {metric: spread.as_record() for metric, spread in vs_before.items()}
        if compiled is not None:
            result["decode_compile"] = compiled["models"][name]
        attempted = {"train", "peak", "decode"} | ({"decode_static", "decode_compiled"} if compiled else set())
        result["verdicts"] = verdicts_of(name, ratio_of[name], vs_before, noise, attempted)
        results.append(result)
    return results


def print_tables(results: list[dict], compiled: dict | None) -> None:
    """The main table, the new ÷ before table and the compiled-decode table."""
    print(f"\n{'model':>22} | {'params':>8} | {'train ms med':>12} {'×Llama [min, max]':>24} | "
          f"{'peak MiB':>8} {'×Llama':>7} | {'decode tok/s':>12} {'×Llama [min, max]':>24} | verdicts")
    for r in results:
        ratios = r["ratios"]
        t, d = Spread(**ratios["train"]), Spread(**ratios["decode"])
        verdicts = [verdict_text(v) for v in r["verdicts"] if v["metric"] in ("train", "peak", "decode")]
        print(f"{r['model']:>22} | {r['params'] / 1e6:7.2f}M | {r['train_ms_median']:12.1f} {t.text():>24} | "
              f"{r['peak_mib']:8.1f} {r['peak_ratio']:6.3f}× | {r['decode_tok_s_median']:12.1f} {d.text():>24} | "
              f"{'; '.join(verdicts)}")
    with_before = [r for r in results if "vs_before" in r]
    if with_before:
        print(f"\n{'new ÷ before':>22} | {'train [min, max]':>24} | {'decode tok/s [min, max]':>24}")
        for r in with_before:
            t, d = Spread(**r["vs_before"]["train"]), Spread(**r["vs_before"]["decode"])
            print(f"{r['model']:>22} | {t.text():>24} | {d.text():>24}")
    if compiled is not None:
        print(f"\nstatic-cache decode, eager and compiled (mode {compiled['mode']}, fullgraph); ×Llama: against "
              "Llama's same mode")
        print(f"{'model':>22} | {'eager tok/s':>11} {'×Llama [min, max]':>24} | {'compiled tok/s':>14} "
              f"{'×Llama [min, max]':>24} | {'compile s':>9} | verdicts")
        for r in results:
            c = r["decode_compile"]
            eager = f"{statistics.median(c['static_tok_s']):11.1f} {Spread(**r['ratios']['decode_static']).text():>24}"
            if "failed" in c:
                fast = f"{'not compiled: ' + c['failed'][:60]:>39} | {'':>9}"
            elif "decode_compiled" in r["ratios"]:
                mismatch = "" if c["tokens_equal_eager"] else " TOKENS DIFFER FROM EAGER"
                fast = (f"{statistics.median(c['compiled_tok_s']):14.1f} "
                        f"{Spread(**r['ratios']['decode_compiled']).text():>24} | {c['compile_s']:9.1f}{mismatch}")
            else:
                fast = (f"{statistics.median(c['compiled_tok_s']):14.1f} {'(Llama not compiled)':>24} | "
                        f"{c['compile_s']:9.1f}")
            verdicts = [verdict_text(v) for v in r["verdicts"] if v["metric"] == "decode_compiled"]
            print(f"{r['model']:>22} | {eager} | {fast} | {'; '.join(verdicts)}")


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict:
    """Build, check, measure, print and record; returns the record."""
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    before = load_before_families(Path(args.before), causal_lm_families()) if args.before else {}
    common = common_fields(args.layers, args.hidden, args.intermediate, args.vocab, args.seq, args.kv_heads)
    if args.models:
        names = [parse_name(n).text for n in args.models.split(",") if n.strip()]
        builders = {name: builder(parse_name(name), common, before, args.backbone) for name in names}
    else:
        names, builders = [], {}
        for name in default_names(args.window, before):
            try:
                builders[name] = builder(parse_name(name), common, before, args.backbone)
                names.append(name)
            except ValueError as error:
                print(f"# {name}: not built ({error})")
    if "llama" not in names:
        raise SystemExit("--models must include llama (every ratio is against it)")
    load_at_start = print_header("bench_models", device,
                 f"{args.backbone} backbone, {args.layers} layers, hidden {args.hidden}, "
                 f"KV heads {common['num_key_value_heads']} of "
                 f"{common['num_attention_heads']}, MLP {args.intermediate}, vocab {args.vocab}, batch {args.batch} × "
                 f"seq {args.seq}, {args.dtype}, attn {args.attn}; {args.reps} interleaved reps"
                 f"{'; train steps torch.compile(model)' if args.compile else ''}"
                 f"{f'; before: {args.before}' if args.before else ''}")

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}
    gates = check_same_function(builders, same_function_pairs(names), batch, device)
    models = {}
    for name in names:
        torch.manual_seed(0)
        model = builders[name]()
        model.config._attn_implementation = args.attn
        models[name] = model.to(device=device, dtype=dtype).train()
    n_params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    if args.compile:
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 4 * len(models))  # see compiled_decode
    steps = {name: make_train_step(torch.compile(m) if args.compile else m, batch) for name, m in models.items()}
    train = interleave(steps, args.reps, device, warmup=2)
    peak = {name: peak_memory_bytes(step, device) / 2**20 for name, step in steps.items()}
    prompt = torch.randint(3, args.vocab, (1, args.prompt), generator=gen).to(device)
    tokens = args.new_tokens * prompt.shape[0]
    decode = tokens_per_second(interleave({n: generate_call(m, prompt, args.new_tokens) for n, m in models.items()},
                                          args.decode_reps, device), tokens)
    compiled = compiled_decode(models, prompt, args, device) if args.decode_compile else None

    results = summarise(names, n_params, train, peak, decode, compiled)
    print_tables(results, compiled)
    spread = {name: (max(v) - min(v)) / statistics.median(v) for name, v in train.items()}
    print("\ntrain-step spread (max-min)/median: " + ", ".join(f"{n} {s:.0%}" for n, s in spread.items()))
    if args.profile:
        for name, step in steps.items():
            profile_step(name, step, 14)
    record = dict(record_header(device, argv, args.label, load_at_start), gates=gates, args=vars(args), targets=TARGETS,
                  context_bounds=CONTEXT, compile=compiled and {k: v for k, v in compiled.items() if k != "models"},
                  results=results)
    if not args.no_save:
        print(f"\nappended to {append_record(args.out, record)}")
    return record


if __name__ == "__main__":
    main()
