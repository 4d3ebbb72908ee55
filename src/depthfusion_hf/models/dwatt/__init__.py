"""DWAtt model family: an HF encoder plus a depth-wise attention (or baseline) layer-fusion head."""

from .configuration_dwatt import FUSION_METHODS, DWAttConfig
from .fusion_dwatt import DWAttConcatFusion, DWAttDeeperFusion, DWAttDepthAttention, DWAttMLP
from .modeling_dwatt import DWAttForTokenClassification, DWAttPreTrainedModel, DWAttTokenClassifierOutput

__all__ = [
    "FUSION_METHODS",
    "DWAttConcatFusion",
    "DWAttConfig",
    "DWAttDeeperFusion",
    "DWAttDepthAttention",
    "DWAttForTokenClassification",
    "DWAttMLP",
    "DWAttPreTrainedModel",
    "DWAttTokenClassifierOutput",
]
