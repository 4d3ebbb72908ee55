#!/usr/bin/env python
"""How far does llama_to_moda move the logits? Train a tiny Llama on a synthetic task, convert, compare."""
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from depthfusion_hf.convert import FFN_KV_INITS, llama_to_moda

torch.set_num_threads(1)
torch.manual_seed(0)
V, T = 64, 32
bigram = torch.randint(0, V, (V,))


def batch(n):
    # first half: a noisy bigram chain; second half: a copy of the first half (induction).
    x = torch.empty(n, T, dtype=torch.long)
    x[:, 0] = torch.randint(0, V, (n,))
    for t in range(1, T // 2):
        noise = torch.rand(n) < 0.3
        x[:, t] = torch.where(noise, torch.randint(0, V, (n,)), bigram[x[:, t - 1]])
    x[:, T // 2:] = x[:, : T // 2]
    return x


cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
llama = LlamaForCausalLM(cfg)
opt = torch.optim.AdamW(llama.parameters(), lr=3e-3)
start = time.time()
for _step in range(400):
    x = batch(32)
    loss = llama(x, labels=x).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"trained llama: loss {loss.item():.3f} ({time.time() - start:.0f}s)")
llama.eval()
x = batch(64)
with torch.no_grad():
    ref = llama(x).logits
    ref_loss = llama(x, labels=x).loss.item()
    print(f"llama eval loss {ref_loss:.4f}")
    for ffn in (False, True):
        for rule in (FFN_KV_INITS if ffn else ("zero",)):
            moda = llama_to_moda(llama, moda_ffn_kv=ffn, ffn_kv_init=rule).eval()
            out = moda(x).logits
            kl = F.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
            agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
            loss_m = moda(x, labels=x).loss.item()
            share = moda.depth_attention_share(x).tolist()
            print(f"ffn_kv={ffn!s:5} init={rule:10} max|dlogit|={(out - ref).abs().max().item():.3f} "
                  f"mean|dlogit|={(out - ref).abs().mean().item():.3f} KL={kl.mean().item():.4f} "
                  f"top1={agree:.3f} loss={loss_m:.4f} depth_share={[round(s, 3) for s in share]}")
