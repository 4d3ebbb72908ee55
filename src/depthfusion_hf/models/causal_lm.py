"""What the four causal families' models share: the decoder stack taken from the backbone, its forward around the
family's layer loop, and the LM head."""

from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaForCausalLM
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .backbones import add_logit_softcapping, build_backbone
from .depthfusion_common import backend_per_device, prepare_decoder_inputs
from .transformers_compat import accepts_cache, cache_kwarg


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


class DepthFusionModel:
    """The forward of every causal family's base model (a mixin before the family's PreTrainedModel, whose
    ``nn.Module.forward`` it replaces): the backbone's
    preamble (:func:`prepare_decoder_inputs`: token check, embeddings, cache, positions, each layer's mask and rotary
    embeddings), the family's layer loop (:meth:`run_layers`) and the final norm. A family sets ``resolve_backend``
    (its op's, chosen once per forward and device) and, where it returns more, ``output_class``."""

    output_class = BaseModelOutputWithPast
    resolve_backend: Callable[..., str]

    @accepts_cache
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        """Run the decoder.

        Args:
            input_ids: [B, T] token ids (or ``inputs_embeds`` [B, T, D]).
            attention_mask: [B, S] padding mask over cached + new positions (1 = keep).
            position_ids: [B, T]; by default continue from the cache length.
            cache: a transformers ``Cache`` (``past_key_values`` is accepted as a deprecated alias).
            use_cache: build a ``DynamicCache`` when none is given.
        Returns:
            ``output_class`` with ``last_hidden_state`` [B, T, D], the final norm of the layer loop's output.
        """
        inputs_embeds, position_ids, cache, per_layer = prepare_decoder_inputs(
            self, input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache
        )
        backend_on = backend_per_device(self.resolve_backend, self.config.op_backend)
        hidden_states = self.run_layers(inputs_embeds, per_layer, cache=cache, position_ids=position_ids,
                                        use_cache=use_cache, backend_on=backend_on, **kwargs)
        return self.output_class(last_hidden_state=self.norm(hidden_states), **cache_kwarg(cache))

    def run_layers(self, inputs_embeds: torch.Tensor, per_layer: list[dict], *, cache: Cache | None,
                   position_ids: torch.LongTensor, use_cache: bool | None, backend_on: Callable[[torch.device], str],
                   **kwargs) -> torch.Tensor:
        """The family's layer loop: ``inputs_embeds`` [B, T, D] -> the final norm's input [B, T, D]; layer i gets
        ``per_layer[i]`` (its mask and rotary embeddings) and ``op_backend=backend_on(its input's device)``."""
        raise NotImplementedError


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


__all__ = ["DepthFusionForCausalLM", "DepthFusionModel", "adopt_backbone"]
