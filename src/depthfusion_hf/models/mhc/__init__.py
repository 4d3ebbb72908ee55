"""mHC model family (manifold-constrained Hyper-Connections, DeepSeek-V4): configuration, modeling and the ops."""

from .configuration_mhc import MHCConfig
from .mhc_connection import hyper_connection, hyper_head
from .mhc_mix import hyper_mix
from .modeling_mhc import (
    MHCDecoderLayer,
    MHCForCausalLM,
    MHCHyperConnection,
    MHCHyperHead,
    MHCModel,
    MHCPreTrainedModel,
)

__all__ = [
    "MHCConfig",
    "MHCDecoderLayer",
    "MHCForCausalLM",
    "MHCHyperConnection",
    "MHCHyperHead",
    "MHCModel",
    "MHCPreTrainedModel",
    "hyper_connection",
    "hyper_head",
    "hyper_mix",
]
