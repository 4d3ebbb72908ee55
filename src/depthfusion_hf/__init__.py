"""depthfusion-hf: DenseFormer, MoDA and DWAtt as Hugging Face model families.

Importing the package registers every model type with ``AutoConfig``, ``AutoModel`` and the task
auto classes, so ``AutoModelForCausalLM.from_pretrained(folder)`` works without remote code.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForTokenClassification

from .models.denseformer import DenseFormerConfig, DenseFormerForCausalLM, DenseFormerModel
from .models.dwatt import DWAttConfig, DWAttForTokenClassification
from .models.moda import MoDAConfig, MoDAForCausalLM, MoDAModel

__version__ = "0.1.0"


def _register(config_cls, base_cls, task_auto, task_cls) -> None:
    AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
    AutoModel.register(config_cls, base_cls, exist_ok=True)
    if task_auto is not None:
        task_auto.register(config_cls, task_cls, exist_ok=True)


_register(DenseFormerConfig, DenseFormerModel, AutoModelForCausalLM, DenseFormerForCausalLM)
_register(MoDAConfig, MoDAModel, AutoModelForCausalLM, MoDAForCausalLM)
# DWAtt has no base model of its own (the encoder is a transformers model), so no AutoModel entry.
AutoConfig.register(DWAttConfig.model_type, DWAttConfig, exist_ok=True)
AutoModelForTokenClassification.register(DWAttConfig, DWAttForTokenClassification, exist_ok=True)

__all__ = [
    "DenseFormerConfig",
    "DenseFormerForCausalLM",
    "DenseFormerModel",
    "MoDAConfig",
    "MoDAForCausalLM",
    "MoDAModel",
    "DWAttConfig",
    "DWAttForTokenClassification",
]
