"""DenseFormer: a decoder (Llama, or another backbone) with a Depth-Weighted Average (DWA) after blocks
(arXiv 2402.02622).

    Y_0 = X_0 = embeddings
    X_i = Block_i(Y_{i-1})                               i = 1..d
    Y_i = sum_{j in S(i)} alpha[i, j] * X_j   if p | i   (a DWA step)
    Y_i = X_i                                 otherwise
    S(i) = { j : 0 <= j <= i, j ≡ i (mod k) }
    logits = lm_head(norm(Y_d))

The blocks, norms, rotary embeddings and attention backends are the backbone's own (transformers' Llama by default;
``backbones.py``), so a checkpoint of the backbone loads by copying weights (see ``depthfusion_hf.convert``) and the
DWA weights start as the identity (``alpha[i, i] = 1``), which makes the DenseFormer *equal* to it at init.
The DWA is per token, so cached decoding needs no cache beyond the ordinary KV cache.
"""

import itertools

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

from .backbones import BACKBONE_LAYER_NAMES, init_backbone_weights
from .causal_lm import DepthFusionForCausalLM, DepthFusionModel, adopt_backbone
from .configuration_denseformer import DenseFormerConfig
from .depthfusion_common import CheckedModelMixin
from .dwa import dwa_core, resolve_backend
from .transformers_compat import cache_kwarg


def dwa_sources(step: int, dilation: int) -> list[int]:
    """S(i): the block indices a DWA step after block ``step`` reads, ``j <= i, j ≡ i (mod k)``."""
    return list(range(step % dilation, step + 1, dilation))


class DenseFormerDWA(nn.Module):
    """All DWA weights of a k×p DenseFormer, packed in one vector ``alphas``.

    The step after block ``i`` (``p | i``) owns ``|S(i)| = i // k + 1`` consecutive entries from ``offsets[i]``,
    ordered like ``S(i)``; the last one is ``alpha[i, i]``. A 1×1 DenseFormer with d blocks has
    ``d (d + 3) / 2`` of them, the only parameters added to the Llama.
    """

    def __init__(self, num_layers: int, dilation: int, period: int):
        super().__init__()
        self.num_layers, self.dilation, self.period = num_layers, dilation, period
        self.steps = list(range(period, num_layers + 1, period))
        self.sources = {i: dwa_sources(i, dilation) for i in self.steps}
        sizes = [len(self.sources[i]) for i in self.steps]
        self.offsets = dict(zip(self.steps, itertools.accumulate([0, *sizes])))
        self.alphas = nn.Parameter(self.identity_alphas(sum(sizes)))
        # Block outputs that some later DWA step reads; the others need not be kept.
        self.needed = sorted({j for i in self.steps for j in self.sources[i]})

    def forward(self, sources: list[torch.Tensor], step: int, backend: str | None = None) -> torch.Tensor:
        """``Y_step = sum_j alpha[step, j] X_j``: ``sources`` the X_j [B, T, D] for j in ``S(step)``, in order;
        ``backend`` the one the model resolved for this forward (None: resolved here). Returns [B, T, D]. The
        sources are the model's own, so the op's input check is skipped (:func:`dwa_core`)."""
        backend = backend or resolve_backend(None, sources[0].device)
        return dwa_core(backend, sources, self.step_weights(step))

    def identity_alphas(self, total: int | None = None) -> torch.Tensor:
        """The initial weights: ``alpha[i, i] = 1`` and 0 elsewhere (the DenseFormer is a plain transformer)."""
        values = torch.zeros(self.alphas.numel() if total is None else total)
        values[[self.offsets[i] + len(self.sources[i]) - 1 for i in self.steps]] = 1.0
        return values

    def step_weights(self, step: int) -> torch.Tensor:
        """The weights of the DWA after block ``step``: [|S(step)|], ordered like ``S(step)``."""
        start = self.offsets[step]
        return self.alphas[start : start + len(self.sources[step])]

    def weight_matrix(self) -> torch.Tensor:
        """Dense view for plotting: [d, d + 1], row ``i - 1`` holds ``alpha[i, j]`` (0 where unconnected, the
        implicit identity ``alpha[i, i] = 1`` for blocks without a DWA step)."""
        matrix = torch.zeros(self.num_layers, self.num_layers + 1, dtype=self.alphas.dtype)
        for i in range(1, self.num_layers + 1):
            if i in self.offsets:
                matrix[i - 1, self.sources[i]] = self.step_weights(i).detach().cpu()
            else:
                matrix[i - 1, i] = 1.0
        return matrix

    def extra_repr(self) -> str:
        return f"layers={self.num_layers}, dilation={self.dilation}, period={self.period}, steps={len(self.steps)}"


class DenseFormerPreTrainedModel(CheckedModelMixin, LlamaPreTrainedModel):
    """The backbone's weight initialisation and Llama's capabilities, plus the identity DWA."""

    config: DenseFormerConfig
    config_class = DenseFormerConfig
    _no_split_modules = BACKBONE_LAYER_NAMES
    _can_compile_fullgraph = True  # one-token StaticCache decoding steps compile whole (issue 21)
    _can_record_outputs = {"hidden_states": GradientCheckpointingLayer, "attentions": "self_attn"}

    def _init_weights(self, module: nn.Module) -> None:
        init_backbone_weights(self, module)
        if isinstance(module, DenseFormerDWA):
            # Identity DWA: survives post_init(), re-initialisation, and checkpoints without DWA weights
            # (init.copy_ leaves parameters that were loaded from a checkpoint untouched).
            init.copy_(module.alphas, module.identity_alphas().to(module.alphas.device, module.alphas.dtype))


class DenseFormerModel(DepthFusionModel, DenseFormerPreTrainedModel):
    """The DenseFormer decoder stack: embeddings, blocks with DWA steps, final norm.

    Returns ``BaseModelOutputWithPast`` whose ``last_hidden_state`` is ``norm(Y_d)``: [B, T, D].
    With ``output_hidden_states=True`` the recorded states are the block outputs ``X_i``.
    """

    resolve_backend = staticmethod(resolve_backend)

    def __init__(self, config: DenseFormerConfig):
        super().__init__(config)
        # Differs from the backbone: the Depth-Weighted Average weights.
        adopt_backbone(self, config, dwa=DenseFormerDWA(config.num_hidden_layers, config.dwa_dilation,
                                                        config.dwa_period))
        self.post_init()

    def dwa_weights(self) -> torch.Tensor:
        """The learned DWA weights as a dense [d, d + 1] matrix (0 where not connected)."""
        return self.dwa.weight_matrix()

    def run_layers(self, inputs_embeds: torch.Tensor, per_layer: list[dict], *, cache: Cache | None,
                   position_ids: torch.LongTensor, use_cache: bool | None, backend_on, **kwargs) -> torch.Tensor:
        hidden_states = inputs_embeds
        # Differs from Llama: keep the block outputs X_j that later DWA steps read (X_0 = embeddings).
        needed = self.dwa.needed
        block_outputs: dict[int, torch.Tensor] = {0: hidden_states} if 0 in needed else {}
        for i, (decoder_layer, layer_input) in enumerate(zip(self.layers[: self.config.num_hidden_layers], per_layer),
                                                         start=1):
            hidden_states = decoder_layer(hidden_states, **layer_input, position_ids=position_ids,
                                          **cache_kwarg(cache), use_cache=use_cache, **kwargs)
            if i in needed:
                block_outputs[i] = hidden_states
            if i in self.dwa.offsets:
                # With device_map="auto" over several devices the block outputs may sit on different ones
                # (`.to` is a no-op on one device); calling the module lets accelerate's hooks place (or load
                # offloaded) DWA weights.
                device = hidden_states.device
                sources = [block_outputs[j].to(device) for j in self.dwa.sources[i]]
                hidden_states = self.dwa(sources, i, backend=backend_on(device))
        return hidden_states


class DenseFormerForCausalLM(DenseFormerPreTrainedModel, DepthFusionForCausalLM):
    """DenseFormer with a language-modelling head (``DepthFusionForCausalLM``: ``LlamaForCausalLM``'s forward,
    generation and plans).

    Example:
        >>> from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM
        >>> model = DenseFormerForCausalLM(DenseFormerConfig(num_hidden_layers=4, hidden_size=64,
        ...     intermediate_size=128, num_attention_heads=4, vocab_size=100, dwa_dilation=2))
        >>> model.dwa_weights().shape
        torch.Size([4, 5])
    """

    base_model_class = DenseFormerModel

    def dwa_weights(self) -> torch.Tensor:
        """The learned DWA weights as a dense [d, d + 1] matrix (0 where not connected)."""
        return self.model.dwa_weights()


__all__ = ["DenseFormerForCausalLM", "DenseFormerModel", "DenseFormerPreTrainedModel", "DenseFormerDWA"]
