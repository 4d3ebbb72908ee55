#!/usr/bin/env python
"""LoRA fine-tuning of a DenseFormer with PEFT: adapt a model trained on Genesis–Judges to the Psalms.

    python examples/lora_finetune_denseformer.py                       # about a minute on CPU
    python examples/lora_finetune_denseformer.py --base outputs/clm/denseformer/final   # your own model

Steps:
1. the base model: a tiny 1×1 DenseFormer pre-trained here for a few steps on the first 150 chapters of
   the built-in King James corpus (or ``--base``: any saved DenseFormer folder with its tokenizer);
2. LoRA (r=8) on every attention and MLP projection, the DWA weights trained in full through
   ``modules_to_save=["dwa"]``, fine-tuned with the ``Trainer`` on the Psalms;
3. held-out Psalms loss before and after; the adapter saved, reloaded onto a fresh copy of the base
   (identical logits), merged with ``merge_and_unload`` (the same logits, a plain DenseFormer again)
   and the merged model saved as an ordinary checkpoint.

Everything goes to ``--output_dir`` (default ``outputs/lora_denseformer``, a folder ``.gitignore`` covers, so
a run from the repository root leaves the checkout clean): ``base/``, ``adapter/``, ``merged/`` and
``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed
from transformers.utils import logging

import depthfusion_hf
from depthfusion_hf.data.corpus import load_documents, pack_into_blocks, train_bpe_tokenizer

PSALMS = slice(478, 628)  # chapters 479..628 of the corpus: Psalms 1..150
PRETRAIN = slice(0, 150)  # Genesis 1 .. Judges 21 (roughly)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=None, help="a saved DenseFormer folder with a tokenizer (default: pre-train one)")
    p.add_argument("--output_dir", default="outputs/lora_denseformer")
    p.add_argument("--pretrain_steps", type=int, default=60)
    p.add_argument("--lora_steps", type=int, default=40)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    return p.parse_args()


def trainer_args(output_dir: Path, steps: int, learning_rate: float, batch_size: int) -> TrainingArguments:
    """Short CPU runs: no checkpoints, no loggers, cosine schedule."""
    return TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size, learning_rate=learning_rate, lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 10), weight_decay=0.0, logging_steps=max(1, steps // 4), save_strategy="no",
        report_to="none", use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0, disable_tqdm=True,
    )


def pretrain_base(documents: list[str], out: Path, args: argparse.Namespace):
    """Stand-in for a pre-trained checkpoint: a tiny 1×1 DenseFormer and a BPE tokenizer on ``documents``."""
    tokenizer = train_bpe_tokenizer(documents, vocab_size=512)
    config = depthfusion_hf.DenseFormerConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, dwa_dilation=1, dwa_period=1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = depthfusion_hf.DenseFormerForCausalLM(config)
    blocks = pack_into_blocks(tokenizer, documents, args.block_size)
    Trainer(model=model, args=trainer_args(out / "pretrain_run", args.pretrain_steps, 3e-3, args.batch_size),
            train_dataset=blocks).train()
    model.save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")
    return out / "base"


def mean_loss(model, blocks) -> float:
    """Mean next-token cross-entropy over ``blocks`` (a dataset of [block_size] ``input_ids``/``labels``)."""
    model.eval()
    ids = torch.tensor(blocks["input_ids"])  # (N, T)
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def main() -> None:
    args = parse_args()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    set_seed(0)
    out = Path(args.output_dir)
    documents = load_documents()
    psalms = documents[PSALMS]
    base_dir = Path(args.base) if args.base else pretrain_base(documents[PRETRAIN], out, args)

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    train = pack_into_blocks(tokenizer, psalms[:-10], args.block_size)
    held_out = pack_into_blocks(tokenizer, psalms[-10:], args.block_size, max_blocks=32)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    base_loss = mean_loss(base, held_out)

    # LoRA on every projection; the DWA weights (module `model.dwa`, one vector `alphas`) are few and cheap,
    # so they are trained in full: PEFT keeps a trainable copy and saves it with the adapter.
    lora = LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0,
                      target_modules=LORA_TARGETS, modules_to_save=["dwa"])
    model = get_peft_model(base, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for n, p in model.named_parameters() if ".modules_to_save." not in n)
    print(f"trainable: {trainable:,} of {total:,} parameters ({100 * trainable / total:.2f}%): LoRA r=8 on "
          f"{', '.join(LORA_TARGETS)} + the DWA weights ({base.model.dwa.alphas.numel()})")
    Trainer(model=model, args=trainer_args(out / "lora_run", args.lora_steps, 3e-3, args.batch_size),
            train_dataset=train).train()
    lora_loss = mean_loss(model, held_out)
    print(f"held-out Psalms loss: base {base_loss:.4f} (ppl {math.exp(base_loss):.1f}) -> "
          f"LoRA {lora_loss:.4f} (ppl {math.exp(lora_loss):.1f})")

    probe = torch.tensor(held_out["input_ids"][:2])  # (2, T)
    with torch.no_grad():
        adapted = model(input_ids=probe).logits
    model.save_pretrained(out / "adapter")
    tokenizer.save_pretrained(out / "adapter")
    files = sorted(p.name for p in (out / "adapter").iterdir())
    print(f"adapter saved to {out / 'adapter'}: {', '.join(f for f in files if f.startswith('adapter'))}")

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out / "adapter").eval()
    with torch.no_grad():
        reload_diff = (reloaded(input_ids=probe).logits - adapted).abs().max().item()
    print(f"adapter reloaded onto a fresh base: max |Δlogits| = {reload_diff:.1e}")

    merged = reloaded.merge_and_unload()
    with torch.no_grad():
        merge_diff = (merged(input_ids=probe).logits - adapted).abs().max().item()
    print(f"merge_and_unload -> {type(merged).__name__}: max |Δlogits| = {merge_diff:.1e}")
    merged.save_pretrained(out / "merged")
    tokenizer.save_pretrained(out / "merged")

    prompt = tokenizer("The LORD is my", return_tensors="pt")
    sample = merged.generate(**prompt, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print(f"merged model, greedy: {tokenizer.decode(sample[0])!r}")

    summary = {"base_loss": base_loss, "lora_loss": lora_loss, "trainable_parameters": trainable,
               "total_parameters": total, "reload_max_abs_diff": reload_diff, "merge_max_abs_diff": merge_diff,
               "dwa_moved": not torch.equal(merged.model.dwa.alphas, base.model.dwa.identity_alphas())}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"summary: {out / 'summary.json'}")


if __name__ == "__main__":
    main()
