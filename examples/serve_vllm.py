#!/usr/bin/env python
"""Serve a DenseFormer, AttnRes or mHC model with vLLM and check its completions against transformers' ``generate``.

Needs a venv holding vLLM and this package (``bash scripts/setup_vllm.sh`` makes ``.venv-vllm``; docs/SERVING.md)::

    .venv-vllm/bin/python examples/serve_vllm.py                        # a DenseFormer built here, about a minute
    .venv-vllm/bin/python examples/serve_vllm.py --family mhc --mode compiled
    .venv-vllm/bin/python examples/serve_vllm.py --model outputs/my_run --output_dir outputs/my_run_served

1. The model: a small one of ``--family`` built here (untrained: its text is random words) with a word-level
   tokenizer, or your checkpoint (``--model``: a folder or Hub id of a DenseFormer, AttnRes or mHC model with its
   tokenizer). vLLM's CPU attention needs ``head_dim >= 32``; the model built here has heads of 32.
2. ``save_remote_code_folder`` exports it as a folder holding its own code (``--output_dir``, or a temporary folder):
   vLLM loads it with ``trust_remote_code=True`` and needs nothing of depthfusion-hf.
3. transformers' greedy ``generate`` of each prompt, then vLLM's Transformers backend on the folder,
   ``LLM(model=folder, model_impl="transformers", trust_remote_code=True)``, greedy on the same prompts (both stop
   after the model's EOS). The completions are printed with whether vLLM's tokens equal ``generate``'s; the script
   exits with status 1 if any differ.

The same folder serves over HTTP with ``vllm serve FOLDER --model-impl transformers --trust-remote-code``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast
from transformers.utils import logging

from depthfusion_hf import (
    AttnResConfig,
    AttnResForCausalLM,
    DenseFormerConfig,
    DenseFormerForCausalLM,
    MHCConfig,
    MHCForCausalLM,
)
from depthfusion_hf.export import save_remote_code_folder

SERVED = {  # family -> (config class, model class, its family fields)
    "denseformer": (DenseFormerConfig, DenseFormerForCausalLM, dict(dwa_dilation=2)),
    "attnres": (AttnResConfig, AttnResForCausalLM, dict(attnres_block_size=2)),
    "mhc": (MHCConfig, MHCForCausalLM, dict(hc_mult=4)),
}
WORDS = ["in", "the", "beginning", "was", "word", "and", "light", "darkness", "day", "night", "earth", "heaven",
         "water", "land", "sea", "tree", "fruit", "seed", "man", "woman", "god", "said", "let", "there", "be", "good"]
PROMPTS = ["in the beginning", "and god said let there be light", "the earth was"]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over :data:`WORDS` (ids 0-3: ``<pad> <s> </s> <unk>``), built offline."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def build_model(family: str, tokenizer) -> torch.nn.Module:
    """A 4-layer ``family`` decoder of width 128 (4 query heads of 32, 2 KV heads), float32, seed 0."""
    config_class, model_class, fields = SERVED[family]
    torch.manual_seed(0)
    config = config_class(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, initializer_range=0.2, **fields)
    return model_class(config).eval()


def load_model(path: str):
    """Your checkpoint and its tokenizer. ValueError for a model vLLM cannot serve or a folder without a tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if model.config.model_type not in SERVED:
        raise ValueError(f"--model: a {model.config.model_type!r} model; vLLM serves {sorted(SERVED)} "
                         "(MoDA: generate with transformers' model.generate; docs/SERVING.md)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {path}: no tokenizer there; vLLM needs one beside the model ({error})") from error
    return model, tokenizer


def hf_greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt: at most ``new_tokens`` ids, up to and with the model's EOS."""
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=model.config.pad_token_id,
                              eos_token_id=model.config.eos_token_id)
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    return out[0, len(prompt_ids):].tolist()


def serve(folder: Path, prompts: list[str], new_tokens: int, mode: str):
    """vLLM's greedy outputs for ``prompts`` from the exported ``folder`` (one ``RequestOutput`` per prompt)."""
    from vllm import LLM, SamplingParams

    # On CPU vLLM reserves its KV cache in the machine's memory: a fixed 64 MiB here (docs/SERVING.md, trap 3).
    llm = LLM(model=str(folder), model_impl="transformers", trust_remote_code=True, dtype="float32",
              enforce_eager=mode == "eager", max_model_len=128, seed=0, kv_cache_memory_bytes=64 << 20)
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(SERVED), default="denseformer", help="the model built here")
    parser.add_argument("--model", help="your checkpoint (folder or Hub id) instead of a model built here")
    parser.add_argument("--output_dir", help="where the remote-code folder goes (default: a temporary folder)")
    parser.add_argument("--mode", choices=["eager", "compiled"], default="eager",
                        help="eager: enforce_eager=True; compiled: vLLM's torch.compile (slower to start)")
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--prompts", nargs="+", default=PROMPTS)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max_new_tokens must be >= 1; got {args.max_new_tokens}")
    logging.set_verbosity_error()
    logging.disable_progress_bar()

    if args.model:
        model, tokenizer = load_model(args.model)
    else:
        tokenizer = word_tokenizer()
        model = build_model(args.family, tokenizer)
    family = model.config.model_type
    print(f"[{family}] {type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters")

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.output_dir or Path(tmp) / f"{family}_served")
        save_remote_code_folder(model, folder, tokenizer=tokenizer, check=True)
        print(f"exported to {folder}: {', '.join(sorted(p.name for p in folder.glob('*.py')))}")

        prompt_ids = [tokenizer(prompt).input_ids for prompt in args.prompts]
        want = [hf_greedy(model, ids, args.max_new_tokens) for ids in prompt_ids]  # before vLLM is imported
        outputs = serve(folder, args.prompts, args.max_new_tokens, args.mode)

    equal = 0
    for prompt, ids, hf_tokens, output in zip(args.prompts, prompt_ids, want, outputs):
        same = list(output.prompt_token_ids) == ids and list(output.outputs[0].token_ids) == hf_tokens
        equal += same
        print(f"{prompt!r} -> {output.outputs[0].text!r}  (vLLM tokens == HF generate: {'yes' if same else 'NO'})")
        if not same:
            print(f"    vLLM {list(output.outputs[0].token_ids)}\n    HF   {hf_tokens}")
    print(f"vLLM ({args.mode}) == transformers generate: {equal}/{len(outputs)} prompts")
    return 0 if equal == len(outputs) else 1


if __name__ == "__main__":
    sys.exit(main())
