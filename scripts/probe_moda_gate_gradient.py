"""Measure the closed depth gate's gradient after ``llama_to_moda`` (issue 28): conversion exactness and, for one
batch, |dL/dg| per layer against the other parameters' gradients.

    python scripts/probe_moda_gate_gradient.py                       # random real-size Llama (SmolLM2-135M shape)
    python scripts/probe_moda_gate_gradient.py --gguf PATH.gguf      # a real checkpoint (needs the gguf package)

Prints: max |logit difference| vs the Llama, the loss, the gates' gradient per layer (mean |dL/dg| over heads, max),
and for comparison the RMS gradient of every other parameter tensor (median and max over tensors) and of the new
FFN K/V projections. One batch, one seed: a magnitude, not a training result.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from depthfusion_hf.convert import llama_to_moda

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from wine making. Books became cheaper, "
        "literacy spread across Europe, and scholars could compare identical copies of the same text. ") * 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", help="a GGUF file of a Llama checkpoint (e.g. SmolLM2-135M-Instruct.Q4_1.gguf)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the random Llama")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calibrate", action="store_true",
                        help="scale the gates by each head's depth-to-sequence mass ratio (other tokens of the text)")
    parser.add_argument("--adam_lr", type=float, nargs="*", default=[],
                        help="also take one Adam step on the gates alone at each rate and print the loss after it")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.gguf:
        import os
        folder, name = os.path.split(args.gguf)
        llama = LlamaForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        all_ids = tokenizer(TEXT, return_tensors="pt").input_ids
        ids, calibration = all_ids[:, : args.tokens].repeat(2, 1), all_ids[:, args.tokens: 2 * args.tokens]
    else:
        llama = LlamaForCausalLM(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                             intermediate_size=1536, vocab_size=49152, num_hidden_layers=args.layers,
                                             tie_word_embeddings=True))
        ids, calibration = torch.randint(0, 49152, (2, args.tokens)), torch.randint(0, 49152, (1, args.tokens))
    llama.eval()
    moda = llama_to_moda(llama, calibration_ids=calibration if args.calibrate else None)
    with torch.no_grad():
        want, got = llama(ids).logits, moda(ids).logits
    print(f"layers {llama.config.num_hidden_layers}; max |logit - Llama's| = {(got - want).abs().max().item():.3e} "
          f"(max |logit| {want.abs().max().item():.1f})")
    start = time.process_time()
    loss = moda(ids, labels=ids).loss
    loss.backward()
    llama_loss = llama(ids, labels=ids).loss.item()
    print(f"loss {loss.item():.4f} (Llama {llama_loss:.4f}); backward CPU {time.process_time() - start:.0f} s")
    rms = {name: p.grad.pow(2).mean().sqrt().item() for name, p in moda.named_parameters() if p.grad is not None}
    gates = {name: p.grad for name, p in moda.named_parameters() if name.endswith("depth_gate")}
    for name, grad in gates.items():
        print(f"  {name}: mean |dL/dg| {grad.abs().mean().item():.3e}, max {grad.abs().max().item():.3e}")
    others = [value for name, value in rms.items() if "depth_gate" not in name and "ffn_kv_proj" not in name]
    ffn = [value for name, value in rms.items() if "ffn_kv_proj" in name]
    gate_abs = torch.cat([g.abs() for g in gates.values()])
    print(f"gates: median |dL/dg| {gate_abs.median().item():.3e}, max {gate_abs.max().item():.3e}")
    print(f"Llama parameters (RMS gradient per tensor): median {statistics.median(others):.3e}, max {max(others):.3e}")
    print(f"ffn_kv_proj (RMS gradient per tensor): max {max(ffn) if ffn else 0:.3e} (0 at a closed gate)")
    gate_params = [p for name, p in moda.named_parameters() if name.endswith("depth_gate")]
    start_values = [p.detach().clone() for p in gate_params]
    for lr in args.adam_lr:
        with torch.no_grad():
            for p, value in zip(gate_params, start_values):
                p.copy_(value)
        optimizer = torch.optim.Adam(gate_params, lr=lr)
        optimizer.step()  # the gradients of the first backward
        with torch.no_grad():
            after = moda(ids, labels=ids).loss.item()
            share = moda.depth_attention_share(ids)
        opened = sum(int((p > 0).sum()) for p in gate_params)
        print(f"one Adam step on the gates at lr {lr:g}: loss {loss.item():.4f} -> {after:.4f}; {opened} of "
              f"{sum(p.numel() for p in gate_params)} gates opened; depth share per layer max {share.max().item():.3f}")


if __name__ == "__main__":
    main()
