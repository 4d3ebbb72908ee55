"""DWAtt model family: an HF encoder plus a depth-wise attention (or baseline) layer-fusion head."""

from .configuration_dwatt import FUSION_METHODS, DWAttConfig
from .fusion_dwatt import (
    FUSION_HEADS,
    DWAttConcatFusion,
    DWAttDeeperFusion,
    DWAttDepthAttention,
    DWAttFusionHead,
    DWAttLastLayer,
    DWAttLastLayerNorm,
    DWAttMLP,
)
from .modeling_dwatt import DWAttForTokenClassification, DWAttPreTrainedModel, DWAttTokenClassifierOutput

__all__ = ["FUSION_HEADS", "FUSION_METHODS", "DWAttConcatFusion", "DWAttConfig", "DWAttDeeperFusion",
           "DWAttDepthAttention", "DWAttForTokenClassification", "DWAttFusionHead", "DWAttLastLayer",
           "DWAttLastLayerNorm", "DWAttMLP", "DWAttPreTrainedModel", "DWAttTokenClassifierOutput"]
