"""mHC: a Llama decoder whose residual is ``hc_mult`` = n streams joined by manifold-constrained Hyper-Connections
(DeepSeek-V4; ``../shared/PAPERS.md`` §5, docs/MHC.md).

    X_0 = [e, ..., e]  (the embedding copied n times)   [n, D]
    per sub-layer f:   post, comb, u = hyper_connection(X);  X <- post ⊗ f(norm(u)) + comb^T X  (hyper_mix)
    logits = lm_head(norm(hyper_head(X)))

The attention, MLP, norms and rotary embeddings are transformers' Llama ones under their Llama names; the
hyper-connection parameters are transformers' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` ones (names,
shapes, init), kept in float32. Everything is per token: cached decoding needs only the ordinary KV cache.
"""

import functools

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .backbones import adopt_layer, attention_branch, branch_shape, init_backbone_weights, mlp_branch
from .causal_lm import DepthFusionForCausalLM, DepthFusionModel, adopt_backbone
from .configuration_mhc import MHCConfig
from .depthfusion_common import CheckedModelMixin
from .mhc_connection import (
    hyper_connection_core,
    hyper_connection_weights_reference,
    hyper_head_core,
    resolve_backend,
)
from .mhc_mix import hyper_mix_core
from .transformers_compat import accepts_cache, cache_kwarg


class MHCHyperConnection(nn.Module):
    """The hyper-connection in front of one sub-layer (transformers' ``DeepseekV4HyperConnection``'s parameters).

    Parameters (float32): ``fn`` [(2 + n) n, n D], rows ``[pre | post | comb]``; ``base`` [(2 + n) n];
    ``scale`` [3] (pre, post, comb).
    """

    def __init__(self, config: MHCConfig):
        super().__init__()
        n, rows = config.hc_mult, (2 + config.hc_mult) * config.hc_mult
        self.hc_mult = n
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        self.eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        # fp32 whatever the model's dtype (the paper's; from_pretrained(dtype=...) keeps them too, see
        # MHCPreTrainedModel._keep_in_fp32_modules_strict).
        self.fn = nn.Parameter(torch.empty(rows, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(rows, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, backend: str | None = None):
        """streams [B, T, n, D] -> ``(post [B, T, n], comb [B, T, n, n], collapsed [B, T, D])``; ``backend``: the one
        the model resolved for this forward (None: resolved here). The streams are the model's own, so the op's
        input check is skipped (:func:`hyper_connection_core`)."""
        backend = backend or resolve_backend(None, streams.device)
        return hyper_connection_core(backend, streams, self.fn, self.base, self.scale, self.sinkhorn_iters, self.eps,
                                     self.norm_eps)

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pre, post, comb)`` for streams [B, T, n, D] (the reference formulas; for analysis)."""
        return hyper_connection_weights_reference(streams, self.fn, self.base, self.scale, self.sinkhorn_iters,
                                                  self.eps, self.norm_eps)

    def extra_repr(self) -> str:
        return f"hc_mult={self.hc_mult}, sinkhorn_iters={self.sinkhorn_iters}, eps={self.eps}"


class MHCHyperHead(nn.Module):
    """The final collapse of the streams (transformers' ``DeepseekV4HyperHead``'s parameters, float32):
    ``hc_fn`` [n, n D], ``hc_base`` [n], ``hc_scale`` [1]."""

    def __init__(self, config: MHCConfig):
        super().__init__()
        n = config.hc_mult
        self.hc_mult = n
        self.eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        """streams [B, T, n, D] -> [B, T, D] (``backend`` as :meth:`MHCHyperConnection.forward`)."""
        backend = backend or resolve_backend(None, streams.device)
        return hyper_head_core(backend, streams, self.hc_fn, self.hc_base, self.hc_scale, self.eps, self.norm_eps)

    def weights(self, streams: torch.Tensor) -> torch.Tensor:
        """``pre`` [B, T, n] of the head for streams [B, T, n, D] (the reference formula; for analysis)."""
        return hyper_connection_weights_reference(streams, self.hc_fn, self.hc_base, self.hc_scale, 1, self.eps,
                                                  self.norm_eps, head=True)[0]


class MHCDecoderLayer(GradientCheckpointingLayer):
    """A backbone decoder layer (its attention, MLP, norms under their names, ``backbone_layer``) whose two residual
    connections are hyper-connections.

    Maps streams [B, T, n, D] to streams [B, T, n, D].
    """

    def __init__(self, config: MHCConfig, layer_idx: int, backbone_layer: nn.Module):
        super().__init__()
        adopt_layer(self, backbone_layer)
        self.shape = branch_shape(config)
        self.attn_hc = MHCHyperConnection(config)
        self.ffn_hc = MHCHyperConnection(config)

    @accepts_cache
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        op_backend: str | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        # Differs from Llama: each sub-layer reads the streams collapsed by `pre` (not the residual) and its output
        # is spread over the streams by `post` and added to the streams mixed by `comb` (not to the residual).
        op_backend = op_backend or resolve_backend(None, hidden_states.device)  # the model passes the one it resolved
        post, comb, collapsed = self.attn_hc(hidden_states, op_backend)
        attn_output = attention_branch(
            self,
            self.shape,
            collapsed,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwarg(cache),
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = hyper_mix_core(op_backend, hidden_states, attn_output, post, comb)
        post, comb, collapsed = self.ffn_hc(hidden_states, op_backend)
        mlp_output = mlp_branch(self, self.shape, collapsed)
        return hyper_mix_core(op_backend, hidden_states, mlp_output, post, comb)


class MHCPreTrainedModel(CheckedModelMixin, LlamaPreTrainedModel):
    """Weight initialisation and the transformers capabilities shared by mHC models (Llama's, plus the
    hyper-connections, initialised as transformers' DeepSeek-V4 and kept in float32)."""

    config: MHCConfig
    config_class = MHCConfig
    _no_split_modules = ["MHCDecoderLayer"]
    _keep_in_fp32_modules_strict = ["attn_hc", "ffn_hc", "hc_head"]
    _can_compile_fullgraph = True  # one-token decoding with a StaticCache: tests/mhc/test_compiled_decoding.py
    _can_record_outputs = {
        "hidden_states": MHCDecoderLayer,
        "attentions": "self_attn",
    }

    def _init_weights(self, module: nn.Module) -> None:
        init_backbone_weights(self, module)
        # transformers' DeepSeek-V4 init (init.* leaves parameters loaded from a checkpoint untouched).
        std = self.config.initializer_range
        if isinstance(module, MHCHyperConnection):
            init.normal_(module.fn, mean=0.0, std=std)
            init.zeros_(module.base)
            init.ones_(module.scale)
        elif isinstance(module, MHCHyperHead):
            init.normal_(module.hc_fn, mean=0.0, std=std)
            init.zeros_(module.hc_base)
            init.ones_(module.hc_scale)


class MHCModel(DepthFusionModel, MHCPreTrainedModel):
    """The mHC decoder stack: embeddings copied into n streams, Llama blocks joined by hyper-connections, the
    head collapse and the final norm.

    Returns ``BaseModelOutputWithPast`` whose ``last_hidden_state`` is ``norm(hyper_head(X_L))``: [B, T, D]. With
    ``output_hidden_states=True`` entry 0 is the input streams (the embedding copied n times) and entry i the
    streams after layer i, each [B, T, n, D]; the last entry is ``last_hidden_state`` [B, T, D] (as
    transformers' DeepSeek-V4).
    """

    resolve_backend = staticmethod(resolve_backend)

    def __init__(self, config: MHCConfig):
        super().__init__(config)
        # Differs from the backbone: hyper-connections around each sub-layer, the streams' final collapse.
        adopt_backbone(self, config, lambda index, layer: MHCDecoderLayer(config, index, layer),
                       hc_head=MHCHyperHead(config))
        self.post_init()

    def run_layers(self, inputs_embeds: torch.Tensor, per_layer: list[dict], *, cache: Cache | None,
                   position_ids: torch.LongTensor, use_cache: bool | None, backend_on, **kwargs) -> torch.Tensor:
        # Differs from Llama: the residual is hc_mult streams, each a copy of the embedding, collapsed by the head.
        hidden_states = inputs_embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1)  # (B, T, n, D)
        for decoder_layer, layer_input in zip(self.layers[: self.config.num_hidden_layers], per_layer):
            hidden_states = decoder_layer(hidden_states, **layer_input, position_ids=position_ids, **cache_kwarg(cache),
                                          use_cache=use_cache, op_backend=backend_on(hidden_states.device), **kwargs)
        return self.hc_head(hidden_states, backend_on(hidden_states.device))

    @torch.no_grad()
    def hyper_connection_weights(self, input_ids: torch.LongTensor,
                                 attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The learned hyper-connection weights on a batch, averaged over its real tokens.

        Args:
            input_ids: [B, T] token ids.
            attention_mask: [B, T], 1 for the tokens to average over (default: all).
        Returns:
            float32 tensors on the CPU: ``"pre"`` [L, 2, n] and ``"post"`` [L, 2, n] (sub-layer 0: the attention,
            1: the MLP of each layer), ``"comb"`` [L, 2, n, n] (``comb[l, s, j, k]`` weighs stream j in the new
            stream k) and ``"head"`` [n], the head's ``pre``.
        """
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        token_weights = mask.to(torch.float64) / mask.sum()  # (B, T)
        found: dict[str, list] = {"pre": [], "post": [], "comb": [], "head": []}

        def average(values: torch.Tensor) -> torch.Tensor:  # (B, T, ...) -> (...)
            weights = token_weights.to(values.device).view(*token_weights.shape, *([1] * (values.dim() - 2)))
            return (values.double() * weights).sum(dim=(0, 1)).float().cpu()

        def record(module, args, output, head: bool = False):
            if head:
                found["head"].append(average(module.weights(args[0])))
                return
            for key, values in zip(("pre", "post", "comb"), module.weights(args[0])):
                found[key].append(average(values))

        handles = [self.hc_head.register_forward_hook(functools.partial(record, head=True))]
        for layer in self.layers:
            handles += [layer.attn_hc.register_forward_hook(record), layer.ffn_hc.register_forward_hook(record)]
        try:
            self(input_ids=input_ids, attention_mask=attention_mask)
        finally:
            for handle in handles:
                handle.remove()
        layers, n = len(self.layers), self.config.hc_mult
        return {
            "pre": torch.stack(found["pre"]).view(layers, 2, n),
            "post": torch.stack(found["post"]).view(layers, 2, n),
            "comb": torch.stack(found["comb"]).view(layers, 2, n, n),
            "head": found["head"][0],
        }


class MHCForCausalLM(MHCPreTrainedModel, DepthFusionForCausalLM):
    """mHC with a language-modelling head (``DepthFusionForCausalLM``: ``LlamaForCausalLM``'s forward, generation and
    plans).

    Example:
        >>> from depthfusion_hf import MHCConfig, MHCForCausalLM
        >>> model = MHCForCausalLM(MHCConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
        ...     num_attention_heads=4, vocab_size=100, hc_mult=4))
        >>> model.hyper_connection_weights(torch.tensor([[5, 6, 7]]))["comb"].shape
        torch.Size([2, 2, 4, 4])
    """

    base_model_class = MHCModel

    def hyper_connection_weights(self, input_ids: torch.LongTensor,
                                 attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The learned hyper-connection weights averaged over a batch's real tokens (see ``MHCModel``'s)."""
        return self.model.hyper_connection_weights(input_ids, attention_mask)


@torch.no_grad()
def init_as_residual(model: MHCPreTrainedModel, post_spread: float = 0.5) -> None:
    """Set every hyper-connection so that the streams carry a plain pre-norm residual: the Llama's function, up to
    the norms' epsilon and rounding (the derivation: docs/MHC.md, "Llama upcycling").

    ``fn = 0``, ``scale = 1``; ``pre`` (and the head's) ``= 1/n``; ``comb`` uniform, whose Sinkhorn result has
    every row sum ``rho = 1 - O(eps)``; at sub-layer s (0-based over the 2L sub-layers) ``post_k = rho^(s+1) (1 +
    post_spread t_k)``, ``t`` evenly spaced in [-1, 1] (``post_spread = 0`` would keep the n streams equal forever).

    Args:
        model: an ``MHCModel`` or ``MHCForCausalLM``.
        post_spread: in [0, 1); the relative spread of ``post`` over the streams.
    Raises:
        ValueError: ``post_spread`` outside [0, 1), or ``hc_eps >= 1 / hc_mult`` (``pre = 1/n`` is then out of
            reach: ``pre > eps``).
    """
    config = model.config
    n, eps = config.hc_mult, config.hc_eps
    if isinstance(post_spread, bool) or not isinstance(post_spread, (int, float)) or not 0 <= post_spread < 1:
        raise ValueError(f"post_spread must be a number in [0, 1); got {post_spread!r}")
    if eps >= 1 / n:
        raise ValueError(f"hc_eps ({eps}) must be < 1 / hc_mult ({1 / n}) for pre = 1 / hc_mult")
    # the Sinkhorn result of the uniform softmax (fn = 0, base = 0), through the reference, in float64
    rows = (2 + n) * n
    _, _, comb = hyper_connection_weights_reference(
        torch.ones(1, 1, n, 1, dtype=torch.float64), torch.zeros(rows, n, dtype=torch.float64),
        torch.zeros(rows, dtype=torch.float64), torch.ones(3, dtype=torch.float64), config.hc_sinkhorn_iters, eps,
        config.rms_norm_eps)
    rho = comb[0, 0].sum(-1).mean()
    offsets = torch.linspace(-1, 1, n, dtype=torch.float64) if n > 1 else torch.zeros(1, dtype=torch.float64)
    pre_logit = torch.logit(torch.tensor(1 / n - eps, dtype=torch.float64))
    base_model = model.model if hasattr(model, "model") else model
    connections = [c for layer in base_model.layers for c in (layer.attn_hc, layer.ffn_hc)]
    for sublayer, connection in enumerate(connections):
        post = rho ** (sublayer + 1) * (1 + post_spread * offsets)
        connection.fn.zero_()
        connection.base.copy_(torch.cat([pre_logit.expand(n), torch.logit(post / 2),
                                         torch.zeros(n * n, dtype=torch.float64)]))
        connection.scale.fill_(1.0)
    base_model.hc_head.hc_fn.zero_()
    base_model.hc_head.hc_base.fill_(pre_logit.item())
    base_model.hc_head.hc_scale.fill_(1.0)


__all__ = [
    "MHCDecoderLayer",
    "MHCForCausalLM",
    "MHCHyperConnection",
    "MHCHyperHead",
    "MHCModel",
    "MHCPreTrainedModel",
    "init_as_residual",
]
