"""Step ``decode``: compiled static-cache decoding with CUDA graphs equals eager decoding; tokens/s against Llama
(issues 20, 21).

transformers' Llama (the control) first, then every causal family variant whose model class says
``_can_compile_fullgraph = True`` (the others are recorded as not supported yet, nothing built): a bf16 model
(d_model 1024, 8 heads of 128, GQA 2, 4 layers) decodes 32 tokens greedily after a left-padded batch of 2 prompts
of 128 tokens,

- eagerly with the default (dynamic) cache, and eagerly with ``cache_implementation="static"``;
- with the static cache and the decoding step compiled the way transformers compiles it for a user who serves
  with it: ``compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead")`` (inductor with CUDA graphs).
  dynamo is reset before each model, and every compiled call runs with ``error_on_recompile``: the first call
  compiles (its seconds are reported) and the decoding steps after it, and the later calls, reuse that graph; a
  graph break or a recompile (with the guard that failed) is the sub-check's error.

Check per model, as the other steps check a kernel against its PyTorch path: the logits of every decoding step
against a float32 oracle, one forward of the same weights in float32 over the run's own sequence (prompt and
generated tokens, with the prompt's mask and generate's positions), so each run is compared on its own prefix:
the compiled run's relative error (all steps' logits as one vector) within :func:`common.tolerance` of the eager
dynamic-cache run's (twice the larger of that and bf16's unit roundoff). Greedy tokens of random bf16 models can
part at a near-tie, so whether the compiled tokens equal eager's is recorded (with the first differing step), not
checked. Timing: wall time of whole ``generate`` calls (prefill included), median of ``REPS`` after a warm-up,
tokens/s and the ratio to Llama's same mode. In a smoke run on the CPU (``GPU_CHECK_SMOKE=1``) the shapes are toys
and the backend is ``aot_eager``, for Llama and DenseFormer only (the step's code, not inductor, is what is exercised
there; ``tests/test_compiled_decoding.py`` tests every family's compiled decoding on the CPU).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEVICE, SMOKE, Result, relative_error, size, step_main, sync, tolerance  # noqa: E402

DECODER = dict(vocab_size=size(32000, 128), hidden_size=size(1024, 64), intermediate_size=size(2816, 96),
               num_hidden_layers=size(4, 2), num_attention_heads=size(8, 4), num_key_value_heads=size(4, 2),
               head_dim=size(128, 16), max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
NEW_TOKENS, PROMPT, REPS = size(32, 4), size(128, 9), size(3, 1)
# name -> (model_type, the family fields): the variants of every causal family (Llama: None).
VARIANTS = {
    "llama": (None, {}),
    "denseformer": ("denseformer", dict(dwa_dilation=1, dwa_period=1)),
    "moda": ("moda", {}),
    "attnres-block": ("attnres", dict(attnres_block_size=4)),
    "attnres-full": ("attnres", {}),
    "mhc": ("mhc", {}),
}
SMOKE_VARIANTS = ("llama", "denseformer")  # a smoke run exercises the step's code on the CPU: two models suffice


def model_class(variant: str):
    """The variant's ``*ForCausalLM`` class (transformers' Llama for ``llama``)."""
    from transformers import LlamaForCausalLM

    import depthfusion_hf as dfh

    model_type = VARIANTS[variant][0]
    return LlamaForCausalLM if model_type is None else dfh.get_family(model_type).task_model_class


def build(variant: str):
    """The variant in float32 on the device, eval mode, seed 0."""
    import torch
    from transformers import LlamaConfig

    import depthfusion_hf as dfh

    torch.manual_seed(0)
    model_type, fields = VARIANTS[variant]
    config = LlamaConfig(**DECODER) if model_type is None else dfh.get_family(model_type).config_class(
        **DECODER, **fields)
    return model_class(variant)(config).to(DEVICE, torch.float32).eval()


def compile_config():
    """What a user serving on CUDA passes: fullgraph, CUDA graphs (``reduce-overhead``); a smoke run: aot_eager."""
    from transformers import CompileConfig

    if SMOKE:
        config = CompileConfig(fullgraph=True, backend="aot_eager", mode="default")
    else:
        config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    if DEVICE != "cuda":
        config._compile_all_devices = True  # transformers compiles off CUDA only when asked
    return config


def prompts():
    """``input_ids`` and ``attention_mask`` [2, PROMPT]: the first row left-padded by PROMPT // 7."""
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(2)
    ids = torch.randint(3, DECODER["vocab_size"], (2, PROMPT), generator=gen, device=DEVICE)
    mask = torch.ones_like(ids)
    pad = PROMPT // 7
    mask[0, :pad] = 0
    ids[0, :pad] = DECODER["pad_token_id"]
    return dict(input_ids=ids, attention_mask=mask)


def timed_generate(model, inputs, **kwargs):
    """``(generate output with logits, wall seconds)`` of one greedy call of NEW_TOKENS tokens."""
    import torch

    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, **kwargs)
    sync()
    return out, time.perf_counter() - t0


def median_seconds(model, inputs, **kwargs):
    """``(the last output, median wall seconds over REPS calls)``."""
    times = []
    for _ in range(REPS):
        out, seconds = timed_generate(model, inputs, **kwargs)
        times.append(seconds)
    return out, statistics.median(times)


def first_difference(a, b) -> int | None:
    """The first decoding step where the tokens of two ``generate`` outputs differ (None: they are equal)."""
    differ = (a.sequences[:, -NEW_TOKENS:] != b.sequences[:, -NEW_TOKENS:]).any(dim=0).nonzero()
    return None if differ.numel() == 0 else int(differ[0])


def oracle_error(oracle, out, mask) -> float:
    """Relative error of a run's logits (every decoding step, [NEW_TOKENS, B, V] as one vector) against one float32
    forward of ``oracle`` over the run's sequence, with generate's positions (left padding: the mask's cumsum)."""
    import torch

    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], NEW_TOKENS)], dim=1)[:, :-1]
    ids = out.sequences[:, :-1]
    positions = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 0)
    with torch.no_grad():
        logits = oracle(input_ids=ids, attention_mask=full_mask, position_ids=positions).logits.float()
    want = logits[:, -NEW_TOKENS:].transpose(0, 1)  # [NEW_TOKENS, B, V]
    return relative_error(torch.stack(out.logits).float(), want)


def variant_check(result: Result, variant: str, llama: dict) -> None:
    import torch

    name = f"{variant}: compiled static-cache decoding"
    if SMOKE and variant not in SMOKE_VARIANTS:
        result.measure(name, supported=None, reason=f"a smoke run compiles only {', '.join(SMOKE_VARIANTS)}")
        return
    if not model_class(variant)._can_compile_fullgraph:
        result.measure(name, supported=False, reason="_can_compile_fullgraph is False (not capturable whole yet)")
        return
    oracle, inputs = build(variant), prompts()
    model = copy.deepcopy(oracle).to(torch.bfloat16)
    tokens = NEW_TOKENS * inputs["input_ids"].shape[0]
    timed_generate(model, inputs)  # warm-up (Triton compiles, cuBLAS plans)
    eager, eager_s = median_seconds(model, inputs)
    _, static_s = median_seconds(model, inputs, cache_implementation="static", disable_compile=True)
    config = compile_config()
    torch._dynamo.reset()  # no graph of another model: this one's first compile is not a recompile
    with torch._dynamo.config.patch(error_on_recompile=True):
        _, first_s = timed_generate(model, inputs, cache_implementation="static", compile_config=config)
        compiled, compiled_s = median_seconds(model, inputs, cache_implementation="static", compile_config=config)
    record = dict(eager_tokens_per_s=tokens / eager_s, static_eager_tokens_per_s=tokens / static_s,
                  compiled_tokens_per_s=tokens / compiled_s, first_compiled_call_s=first_s,
                  compiled_over_static_eager=static_s / compiled_s, mode=config.mode, reps=REPS,
                  tokens_equal_eager=first_difference(compiled, eager) is None,
                  first_differing_step=first_difference(compiled, eager))
    if variant == "llama":
        llama.update(record)
    elif llama:
        for key in ("eager_tokens_per_s", "static_eager_tokens_per_s", "compiled_tokens_per_s"):
            record[f"{key.removesuffix('_tokens_per_s')}_x_llama"] = record[key] / llama[key]
    result.measure(name, supported=True, **record)
    error = oracle_error(oracle, compiled, inputs["attention_mask"])
    baseline = oracle_error(oracle, eager, inputs["attention_mask"])
    bound = tolerance(torch.bfloat16, baseline)
    result.check(f"{variant}: compiled static-cache logits as close to float32 as eager's", error <= bound,
                 error_compiled=error, error_eager=baseline, bound=bound)


def run(result: Result, args) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 oracle in float32
    torch.backends.cudnn.allow_tf32 = False
    llama: dict = {}
    for variant in VARIANTS:
        result.attempt(f"{variant}: compiled static-cache decoding", lambda v=variant: variant_check(result, v, llama))


if __name__ == "__main__":
    step_main(run)
