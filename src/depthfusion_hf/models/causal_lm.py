"""What the four causal families' models share: the decoder stack taken from the backbone, and the LM head."""

from collections.abc import Callable

from torch import nn
from transformers import PreTrainedConfig
from transformers.models.llama.modeling_llama import LlamaForCausalLM

from .backbones import add_logit_softcapping, build_backbone


def adopt_backbone(model: nn.Module, config: PreTrainedConfig, wrap_layer: Callable[[int, nn.Module], nn.Module] | None
                   = None, **depth_modules: nn.Module) -> None:
    """Give a family's base ``model`` the backbone's ``embed_tokens``, ``layers`` (each ``wrap_layer(index, layer)``
    where given: the family's decoder layer around the backbone's), then ``depth_modules`` (the family's own
    model-level modules), ``norm`` and ``rotary_emb``, registered in that order."""
    backbone = build_backbone(config)  # the backbone's own embeddings, decoder layers, final norm, rotary
    model.padding_idx = config.pad_token_id
    model.vocab_size = config.vocab_size
    model.embed_tokens = backbone.embed_tokens
    model.layers = backbone.layers if wrap_layer is None else nn.ModuleList(
        [wrap_layer(index, layer) for index, layer in enumerate(backbone.layers)])
    for name, module in depth_modules.items():
        model.add_module(name, module)
    model.norm, model.rotary_emb = backbone.norm, backbone.rotary_emb
    model.gradient_checkpointing = False


class DepthFusionForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` (``forward``, generation, embedding accessors, tied-weight, tensor- and pipeline-parallel
    plans) over the family's base model ``base_model_class``, with Gemma 3's final logit softcapping where the backbone
    has it. A family's causal LM puts its PreTrainedModel first: ``class XForCausalLM(XPreTrainedModel,
    DepthFusionForCausalLM)``."""

    base_model_class: type

    def __init__(self, config: PreTrainedConfig):
        super(LlamaForCausalLM, self).__init__(config)  # past LlamaForCausalLM.__init__, which builds a LlamaModel
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        add_logit_softcapping(self.lm_head, config)
        self.post_init()


__all__ = ["DepthFusionForCausalLM", "adopt_backbone"]
