"""AttnRes model family (Attention Residuals, arXiv 2603.15031): configuration, modeling and the op."""

from .attnres import attention_residual
from .configuration_attnres import AttnResConfig
from .modeling_attnres import AttnResForCausalLM, AttnResMix, AttnResModel, AttnResPreTrainedModel

__all__ = ["AttnResConfig", "AttnResForCausalLM", "AttnResMix", "AttnResModel", "AttnResPreTrainedModel",
           "attention_residual"]
