#!/usr/bin/env python
"""AttnRes A/B: the current AttnRes models against another checkout's, and both against Llama, in one run.

``scripts/bench_models.py`` gives the issue's ratios (AttnRes ÷ Llama); this script answers "did a change
of the op or the model help", which on a shared machine needs the old and new code interleaved in one
process. The AttnRes folder of ``--before`` (a checkout, or its ``models/attnres`` folder, e.g. extracted
with ``git archive <commit> src/depthfusion_hf/models/attnres | tar -x -C /tmp/old``) is imported under
another name. Models (same config and seed as ``bench_models.py``: 12 layers × 256, SwiGLU 704, vocab 8192,
fp32, SDPA; the AttnRes pseudo-queries drawn off their zero init,
identically for the pairs): ``llama``, ``llama-control`` (the run's noise floor), ``full`` / ``block8`` (new) and
``full-before`` / ``block8-before``. Before timing, each before/new pair must give the same loss and
gradients (the gates of ``bench_models.check_same_function``).

Per interleaved repeat (the order of the models reversed every other repeat): one train step (forward with
labels, backward, AdamW step) on batch × seq tokens, and ``--decode-steps`` one-token cached decoding
steps after a 32-token prompt (the model forward only, no ``generate`` overhead). Time is process CPU
time. Reported: medians and [min, max] of the paired ratios against ``llama`` (train: time ratio; decode:
tokens/s ratio). Appended to ``docs/bench/attnres_ab.jsonl`` with the command.

    python scripts/bench_attnres_ab.py --before /tmp/old --reps 7
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import git_commit, load_family_folder, machine_name  # noqa: E402
from bench_models import check_same_function  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import depthfusion_hf  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def load_attnres_folder(folder: Path, name: str = "attnres_before"):
    """Import a self-contained ``models/attnres`` folder (e.g. of an older checkout) as the package ``name``."""
    return load_family_folder(folder, "attnres", name)


def build(args) -> dict[str, torch.nn.Module]:
    """The models of the run, each built from seed 0 (so before/new pairs share their weights)."""
    common = dict(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64, vocab_size=args.vocab,
        max_position_embeddings=max(1024, args.seq * 2), pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    new = depthfusion_hf
    specs = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**common)),
        "llama-control": lambda: LlamaForCausalLM(LlamaConfig(**common)),
        "full": lambda: new.AttnResForCausalLM(new.AttnResConfig(**common)),
        "block8": lambda: new.AttnResForCausalLM(new.AttnResConfig(**common, attnres_block_size=3)),
    }
    if args.before:
        old = load_attnres_folder(Path(args.before))
        specs["full-before"] = lambda: old.AttnResForCausalLM(old.AttnResConfig(**common))
        specs["block8-before"] = lambda: old.AttnResForCausalLM(old.AttnResConfig(**common, attnres_block_size=3))
    models = {}
    for name in args.models.split(",") if args.models else specs:
        torch.manual_seed(0)
        model = specs[name]()
        model.config._attn_implementation = "sdpa"
        if not name.startswith("llama"):  # off the zero init, so that the same-function gate sees every term
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for pname, param in model.named_parameters():
                    if pname.endswith(".query"):
                        param.copy_(torch.randn(param.shape, generator=gen) / param.numel() ** 0.5)
        models[name] = model.train()
    return models


def decode_ms(model, prompt: torch.Tensor, steps: int) -> float:
    """CPU ms per one-token cached forward (greedy next token fed back), after prefilling ``prompt``."""
    model.eval()
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        t0 = time.process_time()
        for _ in range(steps):
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        elapsed = time.process_time() - t0
    model.train()
    return elapsed / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=None, help="a checkout (or its models/attnres folder) to compare with")
    parser.add_argument("--models", default=None, help="comma list (default: all)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=str(REPO / "docs" / "bench" / "attnres_ab.jsonl"))
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    models = build(args)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=gen)
    batch = {"input_ids": ids, "labels": ids}
    pairs = [("full", "full-before"), ("block8", "block8-before")]
    gates = check_same_function(models, batch, pairs)
    prompt = torch.randint(3, args.vocab, (1, 32), generator=gen)
    optimizers = {n: torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1) for n, m in models.items()}

    def train_step(name: str) -> float:
        t0 = time.process_time()
        models[name](**batch).loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        return (time.process_time() - t0) * 1e3

    for name in models:  # warm-up
        train_step(name)
        decode_ms(models[name], prompt, 4)
    train = {n: [] for n in models}
    decode = {n: [] for n in models}
    order = list(models)
    for rep in range(args.reps):
        for name in order if rep % 2 == 0 else reversed(order):
            train[name].append(train_step(name))
            decode[name].append(decode_ms(models[name], prompt, args.decode_steps))

    print(f"# bench_attnres_ab  {machine_name(torch.device('cpu'))}  torch {torch.__version__}  commit {git_commit()}")
    print(f"# {args.layers} layers × {args.hidden}, batch {args.batch} × seq {args.seq}, fp32, 1 thread, "
          f"{args.reps} reps; "
          f"ratios: median [min, max] of paired ratios vs llama")
    results = []
    for name in models:
        t_pairs = [a / b for a, b in zip(train[name], train["llama"])]
        d_pairs = [b / a for a, b in zip(decode[name], decode["llama"])]  # tokens/s ratio
        r_t, r_d = statistics.median(t_pairs), statistics.median(d_pairs)
        print(f"{name:>14} train {statistics.median(train[name]):8.1f} ms  ×{r_t:.3f} [{min(t_pairs):.3f}, "
              f"{max(t_pairs):.3f}] | decode {statistics.median(decode[name]):6.2f} ms/token  ×{r_d:.3f} "
              f"[{min(d_pairs):.3f}, {max(d_pairs):.3f}]")
        results.append(dict(model=name, train_ms=train[name], decode_ms=decode[name], train_ratio_paired_median=r_t,
                            train_ratio_paired_all=t_pairs, decode_ratio_paired_median=r_d,
                            decode_ratio_paired_all=d_pairs))
    if not args.no_save:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                      machine=machine_name(torch.device("cpu")), command="python " + " ".join(sys.argv),
                      label=args.label, gates=gates, torch=torch.__version__, commit=git_commit(), args=vars(args),
                      results=results)
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"appended to {out}")


if __name__ == "__main__":
    main()
