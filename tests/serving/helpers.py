"""Serving-sized tiny models and a tokenizer built offline, exported as remote-code folders for vLLM.

vLLM's CPU attention needs ``head_dim >= 32``, so these are wider than the families' ``TINY`` test shapes
(head_dim 12): hidden 128 over 4 query heads (2 KV heads), 4 layers, a 64-word vocabulary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import CONFIG_MAPPING, GenerationConfig, PreTrainedTokenizerFast

from depthfusion_hf import (
    AttnResConfig,
    AttnResForCausalLM,
    DenseFormerConfig,
    DenseFormerForCausalLM,
    MHCConfig,
    MHCForCausalLM,
    MoDAConfig,
    MoDAForCausalLM,
)
from depthfusion_hf.remote_code import save_remote_code_folder
from tests.attnres.helpers import randomise_attnres
from tests.denseformer.helpers import randomise_dwa
from tests.fresh_process import _BLOCKER as BLOCKER
from tests.mhc.helpers import randomise_mhc

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3
WORDS = [f"w{i}" for i in range(60)]
SERVING_DECODER = dict(
    vocab_size=len(SPECIAL_TOKENS) + len(WORDS),
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=4,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    initializer_range=0.2,  # logits spread enough that greedy tokens vary (and have no near-ties)
)
# Prompts of different lengths (token ids of words only), for a batch.
PROMPTS = [[4 + (7 * i + 3) % 60 for i in range(n)] for n in (3, 9, 5, 14)]
NEW_TOKENS = 8


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``SPECIAL_TOKENS + WORDS`` (whitespace-split; unknown words -> ``<unk>``)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def serving_model(family: str, seed: int = 0, backbone: str = "llama") -> torch.nn.Module:
    """A float32 model of ``family`` at the serving shape on ``backbone`` (issue 30: heads of 32, Gemma 3 with a
    sliding layer of window 4 before a full one and a final logit cap of 0.5), its family weights moved off their
    init."""
    torch.manual_seed(seed)
    shape = dict(SERVING_DECODER)
    if backbone != "llama":
        extra = {"head_dim": 32}
        if backbone == "gemma3_text":
            # a final logit cap that decides tokens (vLLM reads it from the top-level config, not our LM-head hook)
            extra |= {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                      "final_logit_softcapping": 0.5}
        shape = {"backbone_config": CONFIG_MAPPING[backbone](**shape, **extra)}
    if family == "denseformer":
        model = DenseFormerForCausalLM(DenseFormerConfig(**shape, dwa_dilation=2))
        randomise_dwa(model, seed)
    elif family == "attnres":
        model = AttnResForCausalLM(AttnResConfig(**shape, attnres_block_size=2))
        randomise_attnres(model, seed)
    elif family == "mhc":
        model = randomise_mhc(MHCForCausalLM(MHCConfig(**shape, hc_mult=4)), seed)
    elif family == "moda":
        model = MoDAForCausalLM(MoDAConfig(**shape))
    else:
        raise ValueError(f"family must be one of denseformer, attnres, mhc, moda; got {family!r}")
    return model.eval()


def export(family: str, folder: Path, seed: int = 0, backbone: str = "llama") -> tuple[torch.nn.Module, Path]:
    """The model of :func:`serving_model` and its remote-code folder (with the tokenizer) at ``folder``."""
    model = serving_model(family, seed, backbone)
    save_remote_code_folder(model, folder, tokenizer=build_tokenizer())
    return model, folder


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy ``generate`` of one unpadded prompt: exactly ``new_tokens`` generated ids, EOS masked
    until then (``min_new_tokens``, as vLLM's ``min_tokens``). Not ``eos_token_id=None``: ``generate`` fills it from
    the model's generation config and stops at EOS, where vLLM's ``ignore_eos`` goes on."""
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=config)
    return out[0, len(prompt):].tolist()


# vLLM on this 2-core CPU machine: the engine runs in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with the
# one-process executor ("uni"); `gpu_memory_utilization` is the share of the machine's memory vLLM reserves for the KV
# cache on CPU, and its default 0.92 refuses to start beside other processes. See docs/SERVING.md.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ENGINE_ARGS = dict(model_impl="transformers", trust_remote_code=True, dtype="float32", max_model_len=128,
                   max_num_seqs=8, seed=0, gpu_memory_utilization=0.08, distributed_executor_backend="uni")

OFFLINE_SCRIPT = """
import json, sys, time, traceback
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
folders, mode, prompts, new_tokens, engine_args = sys.argv[1:6]
params = SamplingParams(temperature=0, max_tokens=int(new_tokens), min_tokens=int(new_tokens))
for folder in json.loads(folders):
    start = time.perf_counter()
    try:
        llm = LLM(model=folder, enforce_eager=mode == "eager", **json.loads(engine_args))
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(prompts)], params)
        result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
        llm.llm_engine.engine_core.shutdown()
        del llm
    except Exception:
        result = {"error": traceback.format_exc()[-6000:]}
    result |= {"folder": folder, "seconds": time.perf_counter() - start}
    print("RESULT " + json.dumps(result), flush=True)
"""


def vllm_child(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``python -c`` with ``args`` in a fresh interpreter where ``depthfusion_hf`` cannot be imported (the served
    folder's remote code must do without it), with :data:`VLLM_ENV`."""
    env = {**os.environ, **VLLM_ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    blocker = BLOCKER.format(blocked={"depthfusion_hf"})
    return subprocess.run([sys.executable, "-c", blocker + args[0], *args[1:]], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=tempfile.gettempdir())


def vllm_greedy_each(folders: list[Path], mode: str, prompts: list[list[int]],
                     new_tokens: int = NEW_TOKENS) -> dict[str, dict]:
    """Serve each exported folder in turn in ONE fresh interpreter (vLLM imported once; an engine built, used and
    shut down per folder) and return, per folder path, ``{"tokens": [[id, ...] per prompt], "seconds": s}`` or
    ``{"error": traceback, "seconds": s}`` when that folder failed (the others still run). ``mode`` ``"eager"``
    (``enforce_eager=True``) or ``"compiled"`` (vLLM's torch.compile). AssertionError with vLLM's output when the
    interpreter itself fails."""
    names = [str(folder) for folder in folders]
    proc = vllm_child([OFFLINE_SCRIPT, json.dumps(names), mode, json.dumps(prompts), str(new_tokens),
                       json.dumps(ENGINE_ARGS)], timeout=300 + 240 * len(names))
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    found = {result.pop("folder"): result for result in results}
    if proc.returncode != 0 or sorted(found) != sorted(names):
        raise AssertionError(f"vLLM failed (rc={proc.returncode}, served {sorted(found)}):\n{proc.stderr[-6000:]}")
    return found

