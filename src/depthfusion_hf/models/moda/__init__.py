"""MoDA model family (configuration, modeling and the mixture-of-depths attention op)."""

from .configuration_moda import MoDAConfig
from .moda_attention import moda_attention
from .modeling_moda import MoDAForCausalLM, MoDAModel, MoDAPreTrainedModel

__all__ = [
    "MoDAConfig",
    "MoDAForCausalLM",
    "MoDAModel",
    "MoDAPreTrainedModel",
    "moda_attention",
]
