"""One entry point for upcycling a pretrained Llama into a depth-fusion family: :func:`upcycle`.

    from depthfusion_hf import source_tokenizer, upcycle

    model = upcycle("HuggingFaceTB/SmolLM2-135M", "denseformer")                  # a Hub id (or a folder)
    model = upcycle(folder, "mhc", gguf_file="model.Q4_1.gguf", hc_mult=4)        # a GGUF file in a folder
    model = upcycle(llama, "attnres", attnres_block_size=8)                       # a LlamaForCausalLM object
    upcycle(folder, "moda", save_to="out/moda")            # the model, saved with the source's tokenizer
    tokenizer = source_tokenizer(folder, gguf_file="model.Q4_1.gguf")             # chat template included

The family's converter in the registry (``FAMILIES[family].from_llama``: ``convert.llama_to_denseformer``,
``llama_to_moda``, ``llama_to_attnres``, ``llama_to_mhc``) does the conversion; this module resolves the source
once, checks the options against that converter's signature, and keeps what a user relies on besides the weights.
"""

from __future__ import annotations

import inspect
import os
import warnings
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel

from .convert import _HUB_KWARGS, LOAD_OPTIONS, load_source
from .families import FAMILIES


def upcyclable_families() -> tuple[str, ...]:
    """The ``model_type`` of every family a Llama can be upcycled into (its registry entry has ``from_llama``)."""
    return tuple(name for name, family in FAMILIES.items() if family.from_llama is not None)


def family_options(family: str) -> tuple[str, ...]:
    """The options ``family``'s converter takes (``dwa_dilation``, ``hc_mult``, ...), from its signature.

    Raises:
        ValueError: ``family`` cannot be upcycled into (names those that can).
    """
    if family not in upcyclable_families():
        raise ValueError(f"family must be one of {list(upcyclable_families())}; got {family!r}")
    parameters = list(inspect.signature(FAMILIES[family].from_llama).parameters.values())[1:]  # after the source
    return tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def source_tokenizer(model_or_path, gguf_file: str | None = None, **hub_kwargs):
    """The tokenizer of a source checkpoint (special tokens and chat template included), or ``None`` where it has
    none: a model object (pass its tokenizer yourself), or a folder without tokenizer files.

    With ``gguf_file``: the tokenizer transformers builds from the GGUF metadata, read from the cached float folder
    (:func:`depthfusion_hf.gguf_source.gguf_float_folder`).

    Raises:
        OSError: a Hub id that cannot be reached or has no tokenizer (from transformers).
    """
    if isinstance(model_or_path, torch.nn.Module):
        return None
    if gguf_file is not None:
        from .gguf_source import gguf_float_folder

        return AutoTokenizer.from_pretrained(gguf_float_folder(model_or_path, gguf_file, **hub_kwargs))
    folder = Path(model_or_path)
    if folder.is_dir() and not any((folder / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        return None
    return AutoTokenizer.from_pretrained(model_or_path, **hub_kwargs)


def upcycle(
    model_or_path: PreTrainedModel | str | os.PathLike,
    family: str,
    *,
    tokenizer=None,
    save_to: str | os.PathLike | None = None,
    overwrite: bool = False,
    **options,
) -> PreTrainedModel:
    """Upcycle a pretrained Llama into ``family``: every Llama weight copied, the family's new parameters at their
    conversion init (each converter's docstring states how close the converted model's logits are to the Llama's;
    measured on SmolLM2-135M in docs/RESULTS.md).

    The converted model keeps the Llama's generation config (``model.generation_config``: end tokens, sampling
    settings), special token ids, dtype, device and train/eval mode; its config drops ``quantization_config`` (a
    GGUF source is dequantised to float, so the model saves like any other). A tokenizer is not part of a model:
    :func:`source_tokenizer` returns the source's, and ``save_to`` writes it with the model.

    Args:
        model_or_path: a ``LlamaForCausalLM`` object, a local folder or a Hub id; with ``gguf_file=`` a GGUF file in
            that folder / Hub repository (dequantised once and cached, see ``depthfusion_hf.gguf_source``).
        family: one of :func:`upcyclable_families` (``"denseformer"``, ``"moda"``, ``"attnres"``, ``"mhc"``).
        tokenizer: the tokenizer to save with the model (``save_to``); default: the source's.
        save_to: when given, the converted model is also written there as a remote-code folder with the tokenizer
            (chat template) and generation config (``save_remote_code_folder``'s rules: never over a folder this
            package did not write unless ``overwrite``).
        overwrite: see ``save_to``.
        options: the family's options (:func:`family_options`, e.g. ``dwa_dilation``, ``attnres_block_size``,
            ``hc_mult``) and, for a folder / Hub id, the loading options ``gguf_file``, ``dtype``,
            ``attn_implementation``, ``revision``, ``token``, ... (``convert.LOAD_OPTIONS``).
    Returns:
        The converted ``...ForCausalLM`` on the Llama's device and dtype.
    Raises:
        ValueError: an unknown family or option (naming the allowed ones), a source that is not a Llama, or an
            option value the family refuses.
        OSError: a source that cannot be found.
    """
    allowed = family_options(family)
    unknown = sorted(set(options) - set(allowed) - set(LOAD_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for family {family!r}: its options are {list(allowed)}; the "
                         f"loading options are {list(LOAD_OPTIONS)}")
    load = {key: value for key, value in options.items() if key in LOAD_OPTIONS}
    llama = load_source(model_or_path, **load)
    model = FAMILIES[family].from_llama(llama, **{key: value for key, value in options.items() if key in allowed})
    if save_to is not None:
        if tokenizer is None:
            hub = {key: value for key, value in load.items() if key in _HUB_KWARGS}
            tokenizer = source_tokenizer(model_or_path, load.get("gguf_file"), **hub)
        if tokenizer is None:
            warnings.warn(f"saving the upcycled model to {save_to} without a tokenizer: the source has none here; "
                          "pass tokenizer=", stacklevel=2)
        from .remote_code import save_remote_code_folder

        save_remote_code_folder(model, save_to, tokenizer=tokenizer, overwrite=overwrite)
    return model


__all__ = ["family_options", "source_tokenizer", "upcyclable_families", "upcycle"]
