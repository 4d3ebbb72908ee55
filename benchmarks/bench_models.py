#!/usr/bin/env python
"""Training-step time, peak memory and decode tokens/s: DenseFormer 1×1 / 4×5, MoDA, Llama.

Every model gets the same Llama configuration (default: 12 layers, hidden 256, 4 heads × 64,
SwiGLU 704, vocab 8192, seq 256, batch 4, fp32, SDPA attention) and is measured in one run with
interleaved repeats (model A, B, C, D, A, B, ...), so machine load hits all of them alike; the
table reports medians and ratios against transformers' own ``LlamaForCausalLM``.

- train step: forward with labels + backward + AdamW step + zero_grad;
- peak memory: bytes allocated during one train step above what was allocated before it (CPU: the
  profiler's allocation trace; CUDA: ``max_memory_allocated``);
- decode: ``generate`` with the KV cache, greedy, batch 1, a 32-token prompt, 64 new tokens;
- ``llama-control``: a second, identical Llama measured like the others: its ratio against
  ``llama`` is the noise floor of the run (placement, other jobs on shared cores);

Time is process CPU time on CPU (the cores are shared), wall time on CUDA. Ratios and verdicts use
the median over repeats of the paired ratio (repeat i of a model ÷ repeat i of Llama, measured back to
back), printed with its [min, max] spread; the record also keeps the min- and median-based ratios.

MoDA variants (issue 10): ``moda`` (FFN-side K/V, the paper's default), ``moda-noffn``,
``moda-w<W>`` (``moda_depth_window=W``, ``--window``), ``moda-ckpt`` / ``llama-ckpt`` (gradient
checkpointing: its memory saving); ``--before <checkout>`` adds ``moda-before[-noffn|-ckpt]``, the
MoDA folder of another checkout imported under another name, so old and new code run interleaved
in one process. Before timing, MoDA pairs that compute the same function (new vs before, checkpointed
vs not) must give the same loss and gradients within the gates of :func:`check_same_function`.

Targets on CPU (issue 5): DenseFormer 4×5 train ≤ 1.03× Llama, 1×1 ≤ 1.10×; decode ≥ 0.95×;
MoDA train ≤ 1.15×. ``--profile`` prints the top operators of each model's train step next to
Llama's, to explain a missed target. ``--compile`` times the train step of ``torch.compile(model)`` (inductor)
for every model instead (decode stays eager). Results are appended to ``docs/bench/models.jsonl``.

    python benchmarks/bench_models.py                 # CPU, fp32, 1 thread
    python benchmarks/bench_models.py --device cuda --dtype bf16 --batch 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import DTYPES, clock, git_commit, load_family_folder, machine_name, peak_memory_bytes, sync  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import depthfusion_hf  # noqa: E402
from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGETS = {  # ratios against Llama: train ≤ bound, peak ≤ bound, decode ≥ bound
    "denseformer-4x5": {"train": 1.03, "decode": 0.95},
    "denseformer-1x1": {"train": 1.10, "decode": 0.95},
    "moda": {"train": 1.15, "peak": 1.25, "decode": 0.90},  # issue 10
    "moda-noffn": {"train": 1.06, "peak": 1.25, "decode": 0.90},
    "attnres-full": {"train": 1.20, "decode": 0.93},  # issue 13
    "attnres-block8": {"train": 1.08, "decode": 0.93},
}
BEFORE_PACKAGE = "moda_before"  # the MoDA folder of another checkout (--before), imported under this name


def load_moda_folder(folder: Path, name: str = BEFORE_PACKAGE):
    """Import a self-contained ``models/moda`` folder (e.g. of an older checkout) as the package ``name``."""
    return load_family_folder(folder, "moda", name)


def with_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Gradient checkpointing on every decoder layer (transformers' non-reentrant default)."""
    model.activation_checkpointing_enable()
    return model


def build_models(args, device: torch.device, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """Llama and the depth-fusion models with the same configuration and the same seed."""
    common = dict(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_attention_heads=args.hidden // 64, num_key_value_heads=args.kv_heads or args.hidden // 64,
        vocab_size=args.vocab,
        max_position_embeddings=max(1024, args.seq * 2), pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    specs = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**common)),
        # A/A control: a second, identical Llama instance; its ratio is the run's noise floor.
        "llama-control": lambda: LlamaForCausalLM(LlamaConfig(**common)),
        "denseformer-1x1": lambda: DenseFormerForCausalLM(DenseFormerConfig(**common, dwa_dilation=1, dwa_period=1)),
        "denseformer-4x5": lambda: DenseFormerForCausalLM(DenseFormerConfig(**common, dwa_dilation=4, dwa_period=5)),
    }
    specs["llama-ckpt"] = lambda: with_checkpointing(LlamaForCausalLM(LlamaConfig(**common)))
    attnres_cls, attnres_config = depthfusion_hf.AttnResForCausalLM, depthfusion_hf.AttnResConfig  # issue 13
    specs["attnres-full"] = lambda: attnres_cls(attnres_config(**common))
    specs["attnres-block8"] = lambda: attnres_cls(attnres_config(**common, attnres_block_size=3))  # 24/3 = 8 blocks
    if hasattr(depthfusion_hf, "MoDAForCausalLM"):
        moda_cls, moda_config = depthfusion_hf.MoDAForCausalLM, depthfusion_hf.MoDAConfig
        specs["moda"] = lambda: moda_cls(moda_config(**common))
        specs["moda-noffn"] = lambda: moda_cls(moda_config(**common, moda_ffn_kv=False))
        specs["moda-ckpt"] = lambda: with_checkpointing(moda_cls(moda_config(**common)))
        specs[f"moda-w{args.window}"] = lambda: moda_cls(moda_config(**common, moda_depth_window=args.window))
    if args.before:
        before = load_moda_folder(Path(args.before))
        specs["moda-before"] = lambda: before.MoDAForCausalLM(before.MoDAConfig(**common))
        specs["moda-before-noffn"] = lambda: before.MoDAForCausalLM(before.MoDAConfig(**common, moda_ffn_kv=False))
        specs["moda-before-ckpt"] = lambda: with_checkpointing(before.MoDAForCausalLM(before.MoDAConfig(**common)))
    selected = args.models.split(",") if args.models else list(specs)
    models = {}
    for name in selected:
        torch.manual_seed(0)
        model = specs[name]()
        model.config._attn_implementation = args.attn
        models[name] = model.to(device=device, dtype=dtype).train()
    return models


def make_train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """One optimiser step; returns the loss tensor."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def step() -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


SAME_FUNCTION = [("moda", "moda-before"), ("moda-noffn", "moda-before-noffn"), ("moda-ckpt", "moda"),
                 ("moda-before-ckpt", "moda-before"), ("llama-ckpt", "llama")]


def check_same_function(models: dict[str, torch.nn.Module], batch: dict[str, torch.Tensor],
                        pairs=SAME_FUNCTION) -> dict[str, dict]:
    """Pairs of models with the same weights and the same function give the same loss and gradients.

    Gates (fp32): the two paths differ only in the order of floating-point sums (the depth stream forms
    an entry's gradient in one product over its readers, autograd sums per-reader gradients pairwise; a
    recomputed layer repeats the same arithmetic), so the loss must agree to ``64 eps`` relative and
    every parameter gradient to ``256 eps`` relative in norm (measured: about ``11 eps``), not the
    loose 2 % / 5 % a timing script would otherwise tolerate. Returns the measured errors per pair.
    Raises AssertionError when a gate is exceeded.
    """
    measured = {}
    for a, b in pairs:
        if a not in models or b not in models:
            continue
        out = {}
        for name in (a, b):
            model = models[name]
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            out[name] = (loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()})
            model.zero_grad(set_to_none=True)
        eps = torch.finfo(next(models[a].parameters()).dtype).eps
        loss_err = (abs(out[a][0] - out[b][0]) / abs(out[b][0])).item()
        assert loss_err <= 64 * eps, f"{a} vs {b}: loss differs by {loss_err:.2e} relative (gate {64 * eps:.1e})"
        worst, gate = 0.0, 256 * eps
        for n, g in out[b][1].items():
            err = ((out[a][1][n] - g).norm() / g.norm().clamp_min(1e-30)).item()
            assert err <= gate, f"{a} vs {b}: gradient of {n} differs by {err:.2e} relative (gate {gate:.1e})"
            worst = max(worst, err)
        measured[f"{a}|{b}"] = dict(loss_rel=loss_err, grad_rel_worst=worst, loss_gate=64 * eps, grad_gate=gate)
        print(f"# same function: {a} vs {b}: loss rel {loss_err:.1e}, worst gradient rel {worst:.1e} "
              f"(gates {64 * eps:.1e}, {gate:.1e})")
    return measured


def decode_tokens_per_s(model, prompt: torch.Tensor, new_tokens: int, device: torch.device) -> float:
    now = clock(device)
    model.eval()
    with torch.no_grad():
        sync(device)
        t0 = now()
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             use_cache=True, pad_token_id=0)
        sync(device)
        elapsed = now() - t0
    model.train()
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return new_tokens * prompt.shape[0] / elapsed


def profile_step(name: str, step, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"\n--- {name}: top operators of one train step (self CPU time) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--attn", default="sdpa", help="attention implementation for every model")
    parser.add_argument("--models", default=None, help="comma list (default: all available)")
    parser.add_argument("--before", default=None,
                        help="a checkout (or its models/moda folder) whose MoDA runs as moda-before[-noffn|-ckpt]")
    parser.add_argument("--window", type=int, default=4, help="moda_depth_window of the moda-w<W> model")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="num_key_value_heads of every model (default: query heads, MHA; half of them: GQA "
                             "G=2, the MoDA paper's)")
    parser.add_argument("--label", default="", help="free text stored with the record (e.g. the sweep name)")
    parser.add_argument("--reps", type=int, default=9, help="interleaved train-step repeats")
    parser.add_argument("--decode-reps", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on shared machines)")
    parser.add_argument("--profile", action="store_true", help="print the top operators of each train step")
    parser.add_argument("--compile", action="store_true",
                        help="time the train step of torch.compile(model) (inductor; compiled before the warm-up "
                             "steps) for every model; decode runs the eager models")
    parser.add_argument("--out", default=str(REPO / "docs" / "bench" / "models.jsonl"))
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    machine = machine_name(device)
    models = build_models(args, device, dtype)
    print(f"# bench_models  machine: {machine}  torch {torch.__version__}  commit {git_commit()}")
    print(f"# {args.layers} layers, hidden {args.hidden}, KV heads {args.kv_heads or args.hidden // 64} of "
          f"{args.hidden // 64}, MLP {args.intermediate}, vocab {args.vocab}, "
          f"batch {args.batch} × seq {args.seq}, {args.dtype}, attn {args.attn}; {args.reps} interleaved reps, "
          f"{'process CPU time' if device.type == 'cpu' else 'wall time'}"
          f"{'; train steps torch.compile(model)' if args.compile else ''}")
    if "moda" not in models:
        print("# MoDA: depthfusion_hf.MoDAForCausalLM not available, skipped")
    n_params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}
    gates = check_same_function(models, batch)
    steps = {name: make_train_step(torch.compile(m) if args.compile else m, batch) for name, m in models.items()}
    for step in steps.values():  # warm-up (allocator, optimiser state)
        step()
        step()
    now = clock(device)
    train: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.reps):
        for name, step in steps.items():
            sync(device)
            t0 = now()
            step()
            sync(device)
            train[name].append(now() - t0)
    peak = {name: peak_memory_bytes(step, device) / 2**20 for name, step in steps.items()}

    prompt = torch.randint(3, args.vocab, (1, args.prompt), generator=gen).to(device)
    for m in models.values():
        decode_tokens_per_s(m, prompt, 4, device)  # warm-up
    decode: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.decode_reps):
        for name, m in models.items():
            decode[name].append(decode_tokens_per_s(m, prompt, args.new_tokens, device))

    # Ratios per interleaved repeat (rep i of a model ÷ rep i of Llama: load hits both alike); verdicts use the
    # median of these paired ratios, and their min-max spread is reported with it (issue 10: medians, not best).
    t_min = {name: min(v) * 1e3 for name, v in train.items()}
    t_med = {name: statistics.median(v) * 1e3 for name, v in train.items()}
    d_max = {name: max(v) for name, v in decode.items()}
    d_med = {name: statistics.median(v) for name, v in decode.items()}
    base = "llama"
    print(f"\n{'model':>19} | {'params':>8} | {'train ms med':>12} {'×Llama':>7} {'[min, max]':>15} | "
          f"{'peak MiB':>8} {'×Llama':>7} | {'decode tok/s':>12} {'×Llama':>7} {'[min, max]':>15} | targets")
    results = []
    for name in models:
        t_pairs = [a / b for a, b in zip(train[name], train[base])]
        d_pairs = [a / b for a, b in zip(decode[name], decode[base])]
        r_t, r_m, r_d = statistics.median(t_pairs), peak[name] / peak[base], statistics.median(d_pairs)
        values = {"train": r_t, "peak": r_m, "decode": r_d}
        verdicts = []
        for metric, bound in TARGETS.get(name, {}).items():
            ok = values[metric] >= bound if metric == "decode" else values[metric] <= bound
            verdicts.append(f"{metric} {'≥' if metric == 'decode' else '≤'} {bound}: {'met' if ok else 'MISSED'}")
        print(f"{name:>19} | {n_params[name] / 1e6:7.2f}M | {t_med[name]:12.1f} {r_t:6.3f}× "
              f"[{min(t_pairs):.3f}, {max(t_pairs):.3f}] | {peak[name]:8.1f} {r_m:6.3f}× | "
              f"{d_med[name]:12.1f} {r_d:6.3f}× [{min(d_pairs):.3f}, {max(d_pairs):.3f}] | {'; '.join(verdicts)}")
        results.append(dict(model=name, params=n_params[name], train_ms_min=t_min[name], train_ms_median=t_med[name],
                            train_s_all=train[name], peak_mib=peak[name], decode_tok_s_best=d_max[name],
                            decode_tok_s_median=d_med[name], decode_all=decode[name],
                            train_ratio=t_min[name] / t_min[base], train_ratio_median=t_med[name] / t_med[base],
                            train_ratio_paired_median=r_t, train_ratio_paired_all=t_pairs, peak_ratio=r_m,
                            decode_ratio=d_max[name] / d_max[base], decode_ratio_median=d_med[name] / d_med[base],
                            decode_ratio_paired_median=r_d, decode_ratio_paired_all=d_pairs))
    spread = {name: (max(v) - min(v)) / statistics.median(v) for name, v in train.items()}
    print("\ntrain-step spread (max-min)/median: " + ", ".join(f"{n} {s:.0%}" for n, s in spread.items()))

    if args.profile:
        for name, step in steps.items():
            profile_step(name, step, 14)

    if not args.no_save:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), machine=machine,
                      command="python " + " ".join(sys.argv), label=args.label, gates=gates,
                      torch=torch.__version__, commit=git_commit(), args=vars(args), results=results)
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"\nappended to {out}")


if __name__ == "__main__":
    main()
