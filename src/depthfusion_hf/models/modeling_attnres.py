"""AttnRes: a Llama decoder whose residual sums are Attention Residuals (Kimi Team, arXiv 2603.15031).

Sub-layers l = 1..2L (each attention and each MLP) write outputs v_l; v_0 = the token embedding. Where a Llama
feeds sub-layer l with h_l = v_0 + sum_{i<l} v_i, AttnRes feeds it one call of the op (``attnres.py``) over the
*depth state*, per token: h_l = sum_i softmax_i(w_l . RMSNorm_l(s_i)) s_i; logits = lm_head(norm(h_final)), h_final
one more call over all sources. With blocks of S sub-layers (block AttnRes; full AttnRes is S = 1) the state is
the embedding, the finished blocks' sums and the current block's running sum: after sub-layer l it appends v_l
(l starts a block) or adds v_l to its last entry. Sub-layer 1 reads v_0 alone (its call is the identity, not
materialised); layer i owns the calls feeding its MLP (``mlp_res``) and forming its output (``output_res``).
Everything else is transformers' Llama under its Llama names; decoding needs only the ordinary KV cache.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.output_capturing import OutputRecorder

from .attnres import attnres_core, resolve_backend
from .backbones import adopt_layer, attention_branch, branch_shape, init_backbone_weights, mlp_branch
from .causal_lm import DepthFusionForCausalLM, DepthFusionModel, adopt_backbone
from .configuration_attnres import AttnResConfig
from .depthfusion_common import CheckedModelMixin
from .transformers_compat import accepts_cache, cache_kwarg


class AttnResMix(nn.Module):
    """One Attention Residuals call, ``sum_i softmax_i(w . RMSNorm(s_i)) s_i`` per token: ``query`` w [D] (zero at
    init: a uniform average) and ``key_norm_weight`` [D] (the key RMSNorm's weight, ones at init)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = float(eps)
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.key_norm_weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, sources: tuple[torch.Tensor, ...], backend: str | None = None) -> tuple[torch.Tensor, ...]:
        """Mix N sources [B, T, D] into ``(h [B, T, D], alpha [B, T, N] float32)``; ``backend``: the one the model
        resolved for this forward (None: resolved here). The sources are the model's own, so the op's input check
        is skipped (:func:`attnres_core`)."""
        backend = backend or resolve_backend(None, sources[0].device)
        return attnres_core(backend, self.query, sources, self.key_norm_weight, self.eps)

    def extra_repr(self) -> str:
        return f"hidden_size={self.query.numel()}, eps={self.eps}"


def add_to_depth_state(sources: tuple[torch.Tensor, ...], output: torch.Tensor, new_block: bool):
    """The depth state after a sub-layer wrote ``output`` [B, T, D]: a new block, or the current block's sum grown."""
    return (*sources, output) if new_block else (*sources[:-1], sources[-1] + output)


class AttnResDecoderLayer(GradientCheckpointingLayer):
    """A backbone decoder layer (its modules under their names, ``backbone_layer``) whose two residual sums are
    AttnRes calls over the depth state.

    ``forward(hidden_states, *sources, ...)`` returns ``(output, *sources)``: the layer output [B, T, D] (the
    next layer's input) and the depth state grown by its two sub-layer outputs. The state travels as positional
    tensors, so reentrant gradient checkpointing passes their gradients.
    """

    def __init__(self, config: AttnResConfig, layer_idx: int, backbone_layer: nn.Module):
        super().__init__()
        adopt_layer(self, backbone_layer)
        self.shape = branch_shape(config)
        block_size = config.effective_block_size  # sub-layer l (1-based) starts a block when (l - 1) % S == 0
        self.attn_starts_block = (2 * layer_idx) % block_size == 0
        self.mlp_starts_block = (2 * layer_idx + 1) % block_size == 0
        self.mlp_res = AttnResMix(config.hidden_size, config.rms_norm_eps)
        self.output_res = AttnResMix(config.hidden_size, config.rms_norm_eps)

    @accepts_cache
    def forward(
        self,
        hidden_states: torch.Tensor,
        *sources: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        op_backend: str | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, ...]:
        attn_out = attention_branch(
            self,
            self.shape,
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwarg(cache),
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        sources = add_to_depth_state(sources, attn_out, self.attn_starts_block)
        hidden_states, _ = self.mlp_res(sources, op_backend)  # differs from the backbone: residual + attn_out
        mlp_out = mlp_branch(self, self.shape, hidden_states)
        sources = add_to_depth_state(sources, mlp_out, self.mlp_starts_block)
        hidden_states, _ = self.output_res(sources, op_backend)  # differs from the backbone: residual + mlp_out
        return (hidden_states, *sources)


class AttnResPreTrainedModel(CheckedModelMixin, LlamaPreTrainedModel):
    """Weight initialisation and the transformers capabilities shared by AttnRes models."""

    config: AttnResConfig
    config_class = AttnResConfig
    _no_split_modules = ["AttnResDecoderLayer"]
    _can_compile_fullgraph = True  # one-token StaticCache decoding steps compile whole (issue 21, tested)
    _can_record_outputs = {
        "hidden_states": AttnResDecoderLayer,
        "attentions": "self_attn",
        "depth_weights": OutputRecorder(AttnResMix, index=1),
    }

    def _init_weights(self, module: nn.Module) -> None:
        init_backbone_weights(self, module)
        if isinstance(module, AttnResMix):
            # the paper's: uniform averaging (init.* leaves parameters loaded from a checkpoint untouched)
            init.zeros_(module.query)
            init.ones_(module.key_norm_weight)


@dataclass
class AttnResModelOutputWithPast(BaseModelOutputWithPast):
    """``BaseModelOutputWithPast`` plus ``depth_weights`` (``output_depth_weights=True``): one float32 tensor
    [B, T, N_c] per AttnRes call c (sub-layers 2..2L, then the final call), its softmax over its sources."""

    depth_weights: tuple[torch.Tensor, ...] | None = None


class AttnResModel(DepthFusionModel, AttnResPreTrainedModel):
    """The AttnRes decoder stack: embeddings, Llama layers joined by Attention Residuals, final norm.

    ``forward`` takes Llama's arguments and ``output_depth_weights=True``: also return every AttnRes call's softmax
    weights (``depth_weights``). ``last_hidden_state`` is ``norm(h_final)`` [B, T, D]; ``hidden_states`` as for Llama
    (the embedding, then each layer's output, the next layer's input; the last entry replaced by
    ``last_hidden_state``)."""

    output_class = AttnResModelOutputWithPast
    resolve_backend = staticmethod(resolve_backend)

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        adopt_backbone(self, config, lambda index, layer: AttnResDecoderLayer(config, index, layer))
        self.post_init()

    def run_layers(self, inputs_embeds: torch.Tensor, per_layer: list[dict], *, cache: Cache | None,
                   position_ids: torch.LongTensor, use_cache: bool | None, backend_on, **kwargs) -> torch.Tensor:
        # Differs from Llama: the depth state starts as (v_0,); sub-layer 1's AttnRes over it is v_0 itself. (The
        # depth weights of `output_depth_weights=True` are recorded by capture_outputs.)
        kwargs.pop("output_depth_weights", None)
        hidden_states, sources = inputs_embeds, (inputs_embeds,)
        for decoder_layer, layer_input in zip(self.layers[: self.config.num_hidden_layers], per_layer):
            hidden_states, *sources = decoder_layer(hidden_states, *sources, **layer_input, position_ids=position_ids,
                                                    **cache_kwarg(cache), use_cache=use_cache,
                                                    op_backend=backend_on(hidden_states.device), **kwargs)
        return hidden_states

    @torch.no_grad()
    def depth_attention_weights(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, per_token: bool = False
    ) -> torch.Tensor:
        """Every AttnRes call's softmax over its sources, averaged over the real tokens (``attention_mask`` [B, T],
        1 = real) of ``input_ids`` [B, T]: [2L + 1, N_max] float32 (``N_max`` = 2L + 1 full, N + 1 with N blocks), or
        [B, T, 2L + 1, N_max] with ``per_token``. Row c is the call feeding sub-layer c + 1 (row 2L: the final call;
        row 0 is ``[1, 0, ..]``); column i is source i: the embedding (0), then v_i (full) or b_i (block; a row's last
        column is the current block's running sum); entries a call does not have are 0; every row sums to 1."""
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}; "
                             f"got {tuple(attention_mask.shape)}")
        out = self(input_ids, attention_mask=attention_mask, use_cache=False, output_depth_weights=True)
        batch, length = input_ids.shape
        first = out.depth_weights[0].new_ones(batch, length, 1)  # sub-layer 1: all weight on the embedding
        calls = [first, *out.depth_weights]
        n_max = max(alpha.shape[-1] for alpha in calls)
        weights = torch.zeros(batch, length, len(calls), n_max, device=first.device)
        for c, alpha in enumerate(calls):
            weights[:, :, c, : alpha.shape[-1]] = alpha.to(first.device)
        if per_token:
            return weights
        mask = torch.ones(batch, length, device=first.device) if attention_mask is None else attention_mask
        mask = mask.to(device=first.device, dtype=weights.dtype)
        if mask.sum() == 0:
            raise ValueError("attention_mask has no real token to average over")
        return (weights * mask[:, :, None, None]).sum((0, 1)) / mask.sum()


class AttnResForCausalLM(AttnResPreTrainedModel, DepthFusionForCausalLM):
    """AttnRes with a language-modelling head (``DepthFusionForCausalLM``: ``LlamaForCausalLM``'s forward,
    generation and plans).

    Example:
        >>> from depthfusion_hf import AttnResConfig, AttnResForCausalLM
        >>> model = AttnResForCausalLM(AttnResConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
        ...     num_attention_heads=4, vocab_size=100, attnres_block_size=2))
        >>> model.depth_attention_weights(torch.tensor([[5, 6, 7]])).shape  # 2L + 1 calls, N + 1 = 5 sources
        torch.Size([9, 5])
    """

    base_model_class = AttnResModel

    def depth_attention_weights(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, per_token: bool = False
    ) -> torch.Tensor:
        """See :meth:`AttnResModel.depth_attention_weights`: [2L + 1, N_max] (or per token)."""
        return self.model.depth_attention_weights(input_ids, attention_mask=attention_mask, per_token=per_token)


__all__ = ["AttnResDecoderLayer", "AttnResForCausalLM", "AttnResMix", "AttnResModel", "AttnResModelOutputWithPast",
           "AttnResPreTrainedModel"]
