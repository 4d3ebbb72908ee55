"""Step ``decode``: compiled static-cache greedy decoding equals eager greedy decoding, and its tokens/s (issue 21).

For each causal family and transformers' Llama (the control), a bf16 model (d_model 1024, 8 heads of 128, GQA 2,
4 layers) decodes 32 tokens greedily after a left-padded batch of 2 prompts: eagerly with the default cache, then
with ``cache_implementation="static"`` and the decoding step compiled the way transformers compiles it
(``compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead")``: CUDA graphs). The first compiled call
compiles (its seconds are reported); the second must not recompile (``torch.compiler.set_stance
("fail_on_recompile")``) and must give the eager tokens. A family whose ``_can_compile_fullgraph`` is False is
reported as not supporting it yet (nothing is compiled for it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEVICE, Result, size, step_main, sync  # noqa: E402

DECODER = dict(vocab_size=size(32000, 128), hidden_size=size(1024, 64), intermediate_size=size(2816, 96),
               num_hidden_layers=size(4, 2), num_attention_heads=size(8, 4), num_key_value_heads=size(4, 2),
               head_dim=size(128, 16), max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
NEW_TOKENS, PROMPT = size(32, 3), size(128, 9)


def build(family: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import depthfusion_hf as dfh

    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**DECODER))
    else:
        config = {"denseformer": lambda: dfh.DenseFormerConfig(**DECODER, dwa_dilation=1, dwa_period=1),
                  "moda": lambda: dfh.MoDAConfig(**DECODER),
                  "attnres-block": lambda: dfh.AttnResConfig(**DECODER, attnres_block_size=4),
                  "attnres-full": lambda: dfh.AttnResConfig(**DECODER)}[family]()
        model = dfh.get_family(config.model_type).task_model_class(config)
    return model.to(DEVICE, torch.bfloat16).eval()


def timed_generate(model, inputs, **kwargs):
    import torch

    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             **kwargs)
    sync()
    return out, time.perf_counter() - t0


def family_check(result: Result, family: str) -> None:
    import torch
    from transformers import CompileConfig

    model = build(family)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    ids = torch.randint(3, DECODER["vocab_size"], (2, PROMPT), generator=gen, device=DEVICE)
    mask = torch.ones_like(ids)
    pad = PROMPT // 7
    mask[0, :pad] = 0
    ids[0, :pad] = DECODER["pad_token_id"]
    inputs = dict(input_ids=ids, attention_mask=mask)
    timed_generate(model, inputs)  # warm-up (Triton compiles, cuBLAS plans)
    eager, eager_s = timed_generate(model, inputs)
    tokens = NEW_TOKENS * ids.shape[0]
    record = dict(family=family, eager_tokens_per_s=tokens / eager_s,
                  can_compile_fullgraph=bool(getattr(model, "_can_compile_fullgraph", False)))
    if not record["can_compile_fullgraph"]:
        result.measure(f"{family}: compiled static-cache decoding", supported=False,
                       reason="_can_compile_fullgraph is False (not capturable whole yet)", **record)
        return
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    t0 = time.perf_counter()
    timed_generate(model, inputs, cache_implementation="static", compile_config=config)
    record["first_compiled_call_s"] = time.perf_counter() - t0
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled, compiled_s = timed_generate(model, inputs, cache_implementation="static", compile_config=config)
    record["compiled_tokens_per_s"] = tokens / compiled_s
    result.measure(f"{family}: compiled static-cache decoding", supported=True, **record)
    same = compiled.shape == eager.shape and bool((compiled == eager).all())
    mismatch = None if same else int((compiled != eager).nonzero()[0, 1]) if compiled.shape == eager.shape else None
    result.check(f"{family}: compiled static-cache greedy tokens equal eager", same, first_mismatch=mismatch,
                 shapes=[list(eager.shape), list(compiled.shape)])


def run(result: Result, args) -> None:
    for family in ("moda", "attnres-block", "denseformer", "attnres-full", "llama"):
        result.attempt(f"{family}: compiled static-cache decoding", lambda f=family: family_check(result, f))


if __name__ == "__main__":
    step_main(run)
