"""A GGUF checkpoint as a float Llama folder, converted once and cached.

transformers reads a ``.gguf`` file with ``from_pretrained(folder, gguf_file=...)`` and dequantises it to float,
which takes from seconds to minutes; the model it returns keeps a ``quantization_config`` (``quant_method: gguf``)
that no longer describes its float weights and refuses ``save_pretrained``. :func:`gguf_float_folder` does that
load once per file, drops the stale setting, and stores the float model with its tokenizer (chat template
included) and generation config as an ordinary checkpoint folder under the cache directory, keyed by the file's
sha256: any later load is a plain ``from_pretrained(folder)``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedConfig
from transformers.utils import cached_file

from .export_marker import sha256_hex

try:  # newer transformers ask for dequantisation; older ones (5.16.1 has no GgufConfig) always dequantise a GGUF file
    from transformers import GgufConfig

    DEQUANTISE = {"quantization_config": GgufConfig(dequantize=True)}
except ImportError:
    DEQUANTISE = {}

CACHE_ENV = "DEPTHFUSION_HF_CACHE"
SOURCE_FILE = "gguf_source.json"


def cache_root() -> Path:
    """``$DEPTHFUSION_HF_CACHE`` or ``~/.cache/depthfusion_hf``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "depthfusion_hf")


def resolve_gguf(model_or_path: str | os.PathLike, gguf_file: str, **hub_kwargs) -> Path:
    """The local path of ``gguf_file`` in a folder or Hub repository (downloaded into the Hub cache if needed).

    Raises:
        OSError: no such file (from transformers, naming it).
    """
    return Path(cached_file(os.fspath(model_or_path), gguf_file, **hub_kwargs))


def sha256_of(path: str | os.PathLike) -> str:
    """The hex sha256 of a file."""
    with open(path, "rb") as handle:
        return sha256_hex(handle)


def drop_quantization_settings(model) -> None:
    """Remove what a GGUF load leaves on a dequantised model: its quantizer and ``config.quantization_config``."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def gguf_float_folder(model_or_path: str | os.PathLike, gguf_file: str, **hub_kwargs) -> Path:
    """The cached float folder of ``gguf_file`` (in a folder or Hub repository ``model_or_path``), made if missing.

    The folder holds ``model.safetensors`` (float32, the dequantised weights), ``config.json`` without
    ``quantization_config``, ``generation_config.json``, the tokenizer transformers builds from the GGUF metadata
    (vocabulary, special tokens, chat template) and ``gguf_source.json`` (the file it came from and its sha256).
    It is written to a staging folder and renamed into place, so an interrupted conversion leaves no half folder.

    Raises:
        OSError: the GGUF file cannot be found (naming it).
        ValueError: the file is not a Llama-architecture checkpoint (transformers names what it found).
    """
    path = resolve_gguf(model_or_path, gguf_file, **hub_kwargs)
    model_type = PreTrainedConfig.get_config_dict(path.parent, gguf_file=path.name)[0].get("model_type")
    if model_type != "llama":
        raise ValueError(f"{str(path)!r} holds a GGUF checkpoint of architecture {model_type!r}; only Llama "
                         "checkpoints (model_type 'llama') can be upcycled")
    digest = sha256_of(path)
    target = cache_root() / "gguf" / f"{path.stem}-{digest[:16]}"
    if (target / SOURCE_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        llama = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **DEQUANTISE)
        drop_quantization_settings(llama)
        llama.save_pretrained(staging)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(staging)
        record = dict(gguf_file=str(path), sha256=digest, size=path.stat().st_size)
        (staging / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        try:
            staging.rename(target)
        except OSError:  # another process finished the same conversion first
            if not (target / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


__all__ = ["CACHE_ENV", "cache_root", "drop_quantization_settings", "gguf_float_folder", "resolve_gguf", "sha256_of"]
