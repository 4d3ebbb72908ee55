"""The transformers names that differ between the versions this package supports (>= 5.16.1, < 6), decided once.

- The KV-cache keyword. transformers 5.24 renamed ``past_key_values`` to ``cache`` (model, decoder-layer and attention
  forwards, ``create_causal_mask``, the ``*OutputWithPast`` fields); 5.16-5.23 know only ``past_key_values``. Either
  wrong spelling goes wrong quietly: a 5.16-5.23 Llama layer swallows ``cache=`` in its ``**kwargs`` (the KV cache
  stays empty and cached logits drift), and 5.24+ answers ``past_key_values=`` with a FutureWarning. So every call
  into transformers (and into our layers) spells the keyword with :func:`cache_kwarg`, every output's cache is read
  with :func:`output_cache`, and our forwards, whose parameter is ``cache``, take the other name through
  :func:`accepts_cache`.
- ``SubConfigSpec`` (a composite config's sub-config defaults) exists from 5.20; before, a composite config declares
  ``sub_configs`` and builds its sub-config itself (:func:`build_sub_config`), as transformers' own configs did then.
- Activation checkpointing: 5.23 renamed ``gradient_checkpointing_enable`` and
  ``TrainingArguments.gradient_checkpointing`` to ``activation_checkpointing_enable`` and ``activation_checkpointing``
  (the old names warn from then on):
  :func:`enable_activation_checkpointing`, :data:`CHECKPOINTING_TRAINING_ARG`.

The modeling and configuration files import this module with a single-dot import, so transformers copies it into
every saved remote-code folder: it needs only torch and transformers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import transformers
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.utils.deprecation import deprecate_kwarg

try:
    from transformers.configuration_utils import SubConfigSpec
except ImportError:  # transformers < 5.20
    SubConfigSpec = None

OLD_CACHE_KWARG, NEW_CACHE_KWARG = "past_key_values", "cache"


def installed_cache_kwarg() -> str:
    """The KV-cache keyword of the installed transformers, read from the three kinds of API our models call (a layer's
    attention, the causal-mask builder, the output class); ImportError when they disagree (a version in the middle of
    the rename, which no keyword serves)."""
    spellings = {
        "LlamaAttention.forward": inspect.signature(LlamaAttention.forward).parameters,
        "create_causal_mask": inspect.signature(create_causal_mask).parameters,
        "BaseModelOutputWithPast": BaseModelOutputWithPast.__dataclass_fields__,
    }
    found = {api: NEW_CACHE_KWARG if NEW_CACHE_KWARG in names else OLD_CACHE_KWARG for api, names in spellings.items()}
    if len(set(found.values())) != 1:
        raise ImportError(
            f"transformers {transformers.__version__} names the KV cache differently across its API ({found}); "
            "depthfusion_hf supports transformers >= 5.16.1, < 6 with one name throughout: install a release"
        )
    return next(iter(found.values()))


CACHE_KWARG = installed_cache_kwarg()


def cache_kwarg(cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for a call into transformers (or one of our layers): ``**cache_kwarg(cache)``."""
    return {CACHE_KWARG: cache}


def output_cache(outputs: Any) -> Any:
    """The cache a model output (``BaseModelOutputWithPast``, ``CausalLMOutputWithPast``, ...) carries."""
    return getattr(outputs, CACHE_KWARG)


def accepts_cache(forward: Callable) -> Callable:
    """Decorator for our forwards, whose KV-cache parameter is named ``cache``, so that they take the installed
    transformers' spelling: from 5.24 ``past_key_values`` is transformers' deprecated alias (renamed with a
    FutureWarning, as transformers' own forwards do); before, it is the name that version's transformers passes
    (``LlamaForCausalLM.forward``, ``generate``), taken as it is. Both names with two different caches: ValueError."""
    if CACHE_KWARG == NEW_CACHE_KWARG:
        return deprecate_kwarg(OLD_CACHE_KWARG, "5.40.0", new_name=NEW_CACHE_KWARG)(forward)

    @functools.wraps(forward)
    def forward_taking_past_key_values(*args, **kwargs):
        if OLD_CACHE_KWARG in kwargs:
            old, new = kwargs.pop(OLD_CACHE_KWARG), kwargs.get(NEW_CACHE_KWARG)
            if old is not None and new is not None and old is not new:
                raise ValueError("got two different caches, `past_key_values` and `cache`: pass one of them")
            kwargs[NEW_CACHE_KWARG] = new if new is not None else old
        return forward(*args, **kwargs)

    return forward_taking_past_key_values


NEW_CHECKPOINTING = hasattr(PreTrainedModel, "activation_checkpointing_enable")  # transformers >= 5.23
# The TrainingArguments field that turns activation checkpointing on.
CHECKPOINTING_TRAINING_ARG = "activation_checkpointing" if NEW_CHECKPOINTING else "gradient_checkpointing"


def enable_activation_checkpointing(model: PreTrainedModel, checkpoint_kwargs: dict | None = None) -> None:
    """Turn on activation checkpointing of ``model``'s layers; ``checkpoint_kwargs`` go to
    ``torch.utils.checkpoint.checkpoint`` (transformers' default: ``{"use_reentrant": False}``)."""
    if NEW_CHECKPOINTING:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def build_sub_config(value: PreTrainedConfig | dict | None, default_model_type: str) -> PreTrainedConfig | dict | None:
    """A composite config's sub-config as a config object. From 5.20 ``SubConfigSpec`` builds it in
    ``PreTrainedConfig.__post_init__`` (``value`` is returned as given); before, the composite config builds it here
    from a dict (its ``model_type``, else ``default_model_type``) or None (``default_model_type``'s defaults)."""
    if SubConfigSpec is not None or isinstance(value, PreTrainedConfig):
        return value
    if value is None:
        return CONFIG_MAPPING[default_model_type]()
    fields = dict(value)
    return CONFIG_MAPPING[fields.pop("model_type", default_model_type)](**fields)


__all__ = ["CACHE_KWARG", "CHECKPOINTING_TRAINING_ARG", "SubConfigSpec", "accepts_cache", "build_sub_config",
           "cache_kwarg", "enable_activation_checkpointing", "output_cache"]
