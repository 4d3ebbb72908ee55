"""depthfusion-hf: DenseFormer, MoDA and DWAtt as Hugging Face model families.

Importing the package registers every model type of the family registry (:mod:`depthfusion_hf.families`)
with ``AutoConfig``, ``AutoModel`` and the task auto classes, so ``AutoModelForCausalLM.from_pretrained(folder)``
works without remote code.
"""

from transformers import AutoConfig, AutoModel

from .families import FAMILIES, Family, get_family
from .models.configuration_attnres import AttnResConfig
from .models.configuration_denseformer import DenseFormerConfig
from .models.configuration_dwatt import DWAttConfig
from .models.configuration_mhc import MHCConfig
from .models.configuration_moda import MoDAConfig
from .models.modeling_attnres import AttnResForCausalLM, AttnResModel
from .models.modeling_denseformer import DenseFormerForCausalLM, DenseFormerModel
from .models.modeling_dwatt import DWAttForTokenClassification
from .models.modeling_mhc import MHCForCausalLM, MHCModel
from .models.modeling_moda import MoDAForCausalLM, MoDAModel
from .upcycling import source_tokenizer, upcycle

__version__ = "0.1.0"


def _register(family: Family) -> None:
    AutoConfig.register(family.model_type, family.config_class, exist_ok=True)
    if family.base_model_class is not None:  # DWAtt has none: its encoder is a transformers model
        AutoModel.register(family.config_class, family.base_model_class, exist_ok=True)
    family.task_auto_class.register(family.config_class, family.task_model_class, exist_ok=True)


for _family in FAMILIES.values():
    _register(_family)

__all__ = [
    "FAMILIES",
    "Family",
    "get_family",
    "DenseFormerConfig",
    "DenseFormerForCausalLM",
    "DenseFormerModel",
    "MoDAConfig",
    "MoDAForCausalLM",
    "MoDAModel",
    "DWAttConfig",
    "DWAttForTokenClassification",
    "AttnResConfig",
    "AttnResForCausalLM",
    "AttnResModel",
    "MHCConfig",
    "MHCForCausalLM",
    "MHCModel",
    "source_tokenizer",
    "upcycle",
]
