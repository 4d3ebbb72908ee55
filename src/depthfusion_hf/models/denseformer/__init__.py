"""DenseFormer model family (configuration, modeling and the DWA op)."""

from .configuration_denseformer import DenseFormerConfig
from .dwa import depth_weighted_average
from .modeling_denseformer import DenseFormerDWA, DenseFormerForCausalLM, DenseFormerModel, DenseFormerPreTrainedModel

__all__ = ["DenseFormerConfig", "DenseFormerDWA", "DenseFormerForCausalLM", "DenseFormerModel",
           "DenseFormerPreTrainedModel", "depth_weighted_average"]
