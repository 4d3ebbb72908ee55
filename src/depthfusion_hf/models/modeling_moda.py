"""MoDA: a decoder (Llama, Mistral, Qwen2 or Qwen3) whose attention also reads the same token's depth entries
(arXiv 2603.15619).

    layer l, token t:  o = softmax( [q K_seq^T | q K_depth(t)^T] / sqrt(d) ) [V_seq ; V_depth(t)]
    K_depth(t), V_depth(t) = entries written for token t by layers 0..l-1, in write order
        [attn_0, ffn_0, attn_1, ffn_1, ..., attn_{l-1}, ffn_{l-1}]          (2 l entries per KV head)
    attn_i = layer i's own attention K/V of token t (reused, no parameters)
    ffn_i  = ffn_kv_proj_i(FFN input of layer i at token t)  (D -> 2 Hkv d; only with moda_ffn_kv,
             and never for the last layer, whose entry nobody reads)

Depth keys are stored post-RoPE, rotated by their own token's position (the query's): ``R(t) q . R(t) k = q . k``,
so depth attention is position-free and the attention keys are reused as the KV cache holds them. The entries are
the tensors the layers wrote ([B, Hkv, T, d], never copied into a buffer), handed to each layer as positional
arguments (so every checkpointing tracks them) and to ``moda_attention`` as a sequence, one call per layer. They
are per token: a cached forward builds them for its own tokens, and the ``DynamicCache`` is all generation needs.

The embeddings, MLPs, norms and the attention's projections (with their biases and Qwen3's per-head q/k norms) are
the backbone's own modules under its names (``backbones.build_backbone``), so a checkpoint of the backbone converts by
copying its state dict; the depth entries, the FFN-side K/V and the depth gate are the only code of ours.
"""

import copy

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel, apply_rotary_pos_emb
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .backbones import MASK_FUNCTIONS, adopt_layer, decoder_config, init_backbone_weights, layer_types
from .causal_lm import DepthFusionForCausalLM, DepthFusionModel, adopt_backbone
from .configuration_moda import MoDAConfig
from .depthfusion_common import CheckedModelMixin
from .moda_attention import moda_attention, resolve_backend
from .transformers_compat import accepts_cache, cache_kwarg

SUPPORTED_ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


def check_attn_implementation(implementation: str | None) -> None:
    """Raise a ValueError unless MoDA can run ``implementation``; vLLM's (``"vllm"``, its Transformers backend) gets
    why and what to use instead."""
    if implementation in SUPPORTED_ATTN_IMPLEMENTATIONS:
        return
    reason = "depth entries join the softmax, so other attention kernels cannot be used"
    if implementation == "vllm":
        reason = (
            "MoDA cannot be served by vLLM's Transformers backend: its joint softmax over the sequence and the token's "
            "depth entries needs the sequence attention's log-sum-exp, which vLLM's attention function does not "
            "return. Generate with transformers instead (model.generate; docs/SERVING.md)"
        )
    raise ValueError(f"MoDA supports attn_implementation in {SUPPORTED_ATTN_IMPLEMENTATIONS}; got {implementation!r} "
                     f"({reason})")


def depth_window(config: MoDAConfig, layer_idx: int) -> tuple[int, int]:
    """The depth entries ``[start, stop)`` layer ``layer_idx`` reads, in write order.

    Entries are written ``[attn_0, (ffn_0), attn_1, ...]``: ``per_layer`` = 2 with ``moda_ffn_kv``, else 1.
    Layer ``l`` reads those of layers ``max(0, l - W) .. l - 1`` (W = ``moda_depth_window``, None = all).
    """
    per_layer = 2 if config.moda_ffn_kv else 1
    window = config.moda_depth_window
    first = 0 if window is None else max(0, layer_idx - window)
    return first * per_layer, layer_idx * per_layer


def straight_through_clamp(gate: torch.Tensor) -> torch.Tensor:
    """``max(gate, 0)`` with the gradient passed through unchanged (straight-through): a gate pushed below 0 stays
    closed (0, exactly) and still receives the gradient the closed gate would get, so it can reopen."""
    return gate + (gate.clamp_min(0) - gate).detach()


# torch.nn.Module, not nn.Module: transformers' set_attn_implementation refuses a model whose source has a
# "class ...Attention(nn.Module):" that does not use its attention interface (a source-text heuristic); here
# "eager" / "sdpa" select only the mask format, which changing later is fine.
class MoDAAttention(torch.nn.Module):
    """The backbone's attention (Llama's, Mistral's, Qwen2's or Qwen3's: its q/k/v/o projections with their biases,
    Qwen3's per-head ``q_norm`` / ``k_norm``, under their names) whose softmax also covers the token's own depth
    entries. With ``moda_depth_gate``, plus ``depth_gate`` [Hq] and the fixed buffer ``depth_gate_log_scale`` [Hq] on
    layers that read depth entries: each head's depth scores are multiplied by ``max(depth_gate, 0) *
    exp(depth_gate_log_scale)``; the log-scale is 0 unless ``llama_to_moda`` calibrated it. Returns ``(output
    [B, T, D], weights or None, (key, value))``: the joint softmax [B, Hq, T, S + M] (with ``output_attentions``;
    with autograd) and this layer's post-RoPE K/V [B, Hkv, T, d], its depth entry."""

    def __init__(self, config: MoDAConfig, attention: nn.Module):
        """``attention``: the backbone layer's own attention, whose modules this one takes."""
        super().__init__()
        self.config = config
        self.layer_idx, self.head_dim, self.scaling = attention.layer_idx, attention.head_dim, attention.scaling
        self.num_key_value_groups = attention.num_key_value_groups
        self.is_causal = True
        adopt_layer(self, attention)
        self.normalises_heads = hasattr(attention, "k_norm")  # Qwen3: RMSNorm per head of q and k, before RoPE
        # Differs from the backbone: the learned depth gate (not in the paper), where the layer reads depth entries.
        self.depth_gate = None
        if config.moda_depth_gate and self.layer_idx > 0:
            self.depth_gate = nn.Parameter(torch.full((config.num_attention_heads,), config.moda_depth_gate_init))
            # a log, in fp32 arithmetic: calibrated scales reach 1e-11, below float16's range
            self.register_buffer("depth_gate_log_scale", torch.zeros(config.num_attention_heads))

    def effective_depth_gate(self) -> torch.Tensor | None:
        """The factor of each head's depth scores, [Hq] fp32: ``max(depth_gate, 0) * exp(depth_gate_log_scale)``
        (None: no gate)."""
        if self.depth_gate is None:
            return None
        return straight_through_clamp(self.depth_gate.float()) * self.depth_gate_log_scale.float().exp()

    @accepts_cache
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        depth_keys: tuple[torch.Tensor, ...] = (),
        depth_values: tuple[torch.Tensor, ...] = (),
        cache: Cache | None = None,
        op_backend: str | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]:
        """MoDA attention of ``hidden_states`` [B, T, D] over the sequence pool and the token's depth entries
        ``depth_keys`` / ``depth_values`` (this layer's window, each [B, Hkv, T, d]) on backend ``op_backend``."""
        check_attn_implementation(self.config._attn_implementation)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape)  # (B, T, Hq, d)
        key_states = self.k_proj(hidden_states).view(hidden_shape)  # (B, T, Hkv, d)
        if self.normalises_heads:
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)  # (B, H, T, d)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, Hkv, T, d)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        own_entry = (key_states, value_states)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        # Differs from the backbone: the token's own depth entries join the softmax (a sliding window bounds the
        # sequence keys only, through the mask; the depth entries are the query's own token's).
        attn_output = moda_attention(
            query_states, key_states, value_states, depth_keys, depth_values, attention_mask=attention_mask,
            scale=self.scaling, causal=True, backend=op_backend, return_weights=bool(kwargs.get("output_attentions")),
            depth_gate=self.effective_depth_gate(),
        )  # (B, Hq, T, d), or with the weights (B, Hq, T, S + M)
        attn_output, attn_weights = attn_output if isinstance(attn_output, tuple) else (attn_output, None)
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights, own_entry


def depth_rotary(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables of :func:`rotate_depth_key`, built once per forward pass from the model's ``(cos, sin)``
    ([B or 1, T, d]): ``(cos, signed_sin)``, each [B or 1, 1, T, d], ``signed_sin = [-sin_1 | sin_2]`` (halves)."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(1)


def rotate_depth_key(key: torch.Tensor, depth_rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE for a depth key [B, Hkv, T, d], bit for bit Llama's ``key * cos + rotate_half(key) * sin``:
    ``rotate_half(key) * sin = [-k_2 s_1 | k_1 s_2] = roll(key) * signed_sin`` (negation is exact), in four operations
    instead of nine (they run for every layer of every decoding step)."""
    cos, signed_sin = depth_rope
    return (key * cos).add_(key.roll(key.shape[-1] // 2, dims=-1).mul_(signed_sin))


class MoDADecoderLayer(GradientCheckpointingLayer):
    """A backbone block with MoDA attention, an optional FFN-side depth K/V write, and pre- or post-norm:
    ``"pre"`` (the backbones') ``h = x + attn(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))``,
    ``"post"`` ``h = post_attention_layernorm(x + attn(x)); y = post_feedforward_layernorm(h + mlp(h))``;
    ``ffn_kv_proj`` projects the MLP's input. Returns ``(hidden_states [B, T, D], *new_keys, *new_values)``, flat: the
    entries the layer writes, each [B, Hkv, T, d] (one or two keys, as many values; none for the last layer)."""

    def __init__(self, config: MoDAConfig, layer: nn.Module):
        """``layer``: the backbone's own decoder layer of this depth (``LlamaDecoderLayer``, ``Qwen3DecoderLayer``,
        ...), whose attention, MLP and norms this block takes under their names."""
        super().__init__()
        self.hidden_size = config.hidden_size
        self.norm_position = config.norm_position
        self.self_attn = MoDAAttention(config, layer.self_attn)
        layer_idx = self.self_attn.layer_idx
        self.mlp = layer.mlp
        if config.norm_position == "pre":
            self.input_layernorm = layer.input_layernorm
            self.post_attention_layernorm = layer.post_attention_layernorm
        else:
            self.post_attention_layernorm = layer.post_attention_layernorm
            self.post_feedforward_layernorm = copy.deepcopy(layer.post_attention_layernorm)
        self.num_key_value_heads, self.head_dim = config.num_key_value_heads, self.self_attn.head_dim
        self.depth_window = depth_window(config, layer_idx)
        self.writes_depth = layer_idx < config.num_hidden_layers - 1
        # Differs from the backbone: the FFN-side depth K/V ("Extra FFN KV Proj."), laid out [Hkv, 2, d], with a bias
        # where the layer's k_proj has one (Qwen2; Llama with attention_bias) and, on Qwen3, a per-head k-norm of its
        # own (a copy of the attention's): its keys are made as the layer's attention makes its keys (docs/MODA.md).
        self.writes_ffn_kv = config.moda_ffn_kv and self.writes_depth
        if self.writes_ffn_kv:
            self.ffn_kv_proj = nn.Linear(config.hidden_size, 2 * config.num_key_value_heads * self.head_dim,
                                         bias=self.self_attn.k_proj.bias is not None)
            if self.self_attn.normalises_heads:
                self.ffn_k_norm = copy.deepcopy(self.self_attn.k_norm)

    def ffn_entry(self, ffn_input: torch.Tensor, depth_rope: tuple[torch.Tensor, torch.Tensor]):
        """The FFN-side depth K/V of ``ffn_input`` [B, T, D]: key (post-RoPE, at its token's position) and value,
        each [B, Hkv, T, d], dense in [B, T, Hkv, d] order like the attention's K/V (the value is copied out of the
        projection's [Hkv, 2, d] rows: a strided entry sends every later ``torch.cat`` and row view to a slow copy).
        ``depth_rope``: the tables of :func:`depth_rotary`."""
        batch, tokens, _ = ffn_input.shape
        # -1, not num_key_value_heads: under tensor parallelism (colwise plan) this rank holds only its heads.
        key, value = self.ffn_kv_proj(ffn_input).view(batch, tokens, -1, 2, self.head_dim).unbind(dim=3)
        if self.self_attn.normalises_heads:
            key = self.ffn_k_norm(key)
        return rotate_depth_key(key.transpose(1, 2), depth_rope), value.contiguous().transpose(1, 2)

    @accepts_cache
    def forward(
        self,
        hidden_states: torch.Tensor,
        *depth_entries: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        op_backend: str | None = None,
        depth_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, ...]:
        """One block. ``depth_entries``: this layer's window of depth entries, flat ``(*keys, *values)`` (M keys
        then M values, each [B, Hkv, T, d]); positional, so that reentrant checkpointing tracks their gradients
        (it tracks only top-level positional inputs and outputs). ``depth_rope``: :func:`depth_rotary` of
        ``position_embeddings``, built once per pass by the model (here when not given)."""
        pre_norm = self.norm_position == "pre"
        residual = hidden_states
        if pre_norm:
            hidden_states = self.input_layernorm(hidden_states)
        num_keys = len(depth_entries) // 2
        hidden_states, _, (attn_key, attn_value) = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, depth_keys=depth_entries[:num_keys],
            depth_values=depth_entries[num_keys:], position_ids=position_ids, use_cache=use_cache, **cache_kwarg(cache),
            position_embeddings=position_embeddings, op_backend=op_backend, **kwargs,
        )
        hidden_states = residual + hidden_states
        if pre_norm:
            residual = hidden_states
            ffn_input = self.post_attention_layernorm(hidden_states)
        else:
            hidden_states = self.post_attention_layernorm(hidden_states)
            residual = ffn_input = hidden_states
        hidden_states = residual + self.mlp(ffn_input)
        if not pre_norm:
            hidden_states = self.post_feedforward_layernorm(hidden_states)

        if not self.writes_ffn_kv:
            return (hidden_states, attn_key, attn_value) if self.writes_depth else (hidden_states,)
        ffn_key, ffn_value = self.ffn_entry(ffn_input, depth_rope or depth_rotary(*position_embeddings))
        return hidden_states, attn_key, ffn_key, attn_value, ffn_value


def bottom_right_masks(model: nn.Module, per_layer: list[dict], inputs_embeds: torch.Tensor,
                       position_ids: torch.LongTensor, cache: Cache | None) -> list:
    """Each layer's attention mask (``per_layer``: :func:`backbones.layer_inputs`), written out where transformers
    leaves it out for a prefill into an empty fixed-size cache (StaticCache): SDPA's top-left causal alignment over
    all of the cache layer's keys. ``moda_attention`` aligns a missing mask bottom-right (the queries are the last T
    of the S keys), so such a pass needs the mask of the layer's attention type (causal or sliding) written out."""
    tokens = inputs_embeds.shape[1]
    types = layer_types(model.config)
    written: dict[str, torch.Tensor] = {}
    masks = []
    for index, inputs in enumerate(per_layer):
        mask = inputs["attention_mask"]
        if mask is None and cache is not None and tokens > 1 and cache.get_mask_sizes(tokens, index)[0] != tokens:
            if types[index] not in written:
                written[types[index]] = MASK_FUNCTIONS[types[index]](
                    config=decoder_config(model.config), inputs_embeds=inputs_embeds, attention_mask=None,
                    position_ids=position_ids, allow_is_causal_skip=False, **cache_kwarg(cache))
            mask = written[types[index]]
        masks.append(mask)
    return masks


class MoDAPreTrainedModel(CheckedModelMixin, LlamaPreTrainedModel):
    """The backbone's weight initialisation and the transformers capabilities shared by MoDA models (Llama's, except
    that depth entries join the softmax: only our own op runs the attention, so no flash / flex attention, and
    ``"eager"`` / ``"sdpa"`` select only the mask format, additive float or bool / None)."""

    config: MoDAConfig
    config_class = MoDAConfig
    _no_split_modules = ["MoDADecoderLayer"]
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = True  # one-token StaticCache decoding compiles whole (tested)
    _can_record_outputs = {"hidden_states": MoDADecoderLayer, "attentions": MoDAAttention}

    def __init__(self, config: MoDAConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        check_attn_implementation(self.config._attn_implementation)  # e.g. vLLM's, set before it builds the model

    def _init_weights(self, module: nn.Module) -> None:
        init_backbone_weights(self, module)
        if isinstance(module, MoDAAttention) and module.depth_gate is not None:
            # init.constant_ leaves a gate loaded from a checkpoint untouched.
            init.constant_(module.depth_gate, self.config.moda_depth_gate_init)
            init.zeros_(module.depth_gate_log_scale)


class MoDAModel(DepthFusionModel, MoDAPreTrainedModel):
    """The MoDA decoder stack: embeddings, MoDA blocks reading the per-token depth entries, final norm.

    Returns ``BaseModelOutputWithPast`` whose ``last_hidden_state`` is [B, T, D]. With
    ``output_attentions=True`` each layer's ``attentions`` entry is the joint softmax
    [B, Hq, T, S + M_l]: the first S columns are the sequence pool, the last M_l the depth entries.
    """

    resolve_backend = staticmethod(resolve_backend)

    def __init__(self, config: MoDAConfig):
        super().__init__(config)
        adopt_backbone(self, config, lambda index, layer: MoDADecoderLayer(config, layer))
        self.post_init()

    def run_layers(self, inputs_embeds: torch.Tensor, per_layer: list[dict], *, cache: Cache | None,
                   position_ids: torch.LongTensor, use_cache: bool | None, backend_on, **kwargs) -> torch.Tensor:
        hidden_states = inputs_embeds
        masks = bottom_right_masks(self, per_layer, inputs_embeds, position_ids, cache)
        kwargs["output_attentions"] = bool(kwargs.get("output_attentions", self.config.output_attentions))
        # Differs from the backbone: the depth entries written so far.
        types = layer_types(self.config)
        depth_ropes = {kind: depth_rotary(*per_layer[types.index(kind)]["position_embeddings"])
                       for kind in set(types)} if self.config.moda_ffn_kv else {}
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for index, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            start, stop = decoder_layer.depth_window
            hidden_states, *written = decoder_layer(
                hidden_states, *keys[start:stop], *values[start:stop], attention_mask=masks[index],
                position_embeddings=per_layer[index]["position_embeddings"], position_ids=position_ids,
                use_cache=use_cache, op_backend=backend_on(hidden_states.device),
                depth_rope=depth_ropes.get(types[index]), **cache_kwarg(cache), **kwargs,
            )
            keys += written[: len(written) // 2]
            values += written[len(written) // 2:]
        return hidden_states

    @torch.no_grad()
    def depth_attention_share(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                              per_head: bool = False) -> torch.Tensor:
        """Share of attention mass on depth entries, per layer: the paper's attention-sink analysis.

        Args:
            input_ids: [B, T].
            attention_mask: [B, T] padding mask (1 = real token); padded query tokens are not counted.
            per_head: return one value per query head.
        Returns:
            [L] (or [L, Hq]) float32 in [0, 1], the mean over real tokens (and heads) of the softmax mass
            on the token's depth entries. Layer 0 has no depth entries, so its share is 0.
        """
        outputs = self(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_attentions=True)
        seq_len = input_ids.shape[1]
        valid = torch.ones_like(input_ids, dtype=torch.float32) if attention_mask is None else attention_mask.float()
        valid = valid[:, None, :]  # (B, 1, T)
        shares = []
        for weights in outputs.attentions:  # (B, Hq, T, S + M)
            depth_mass = weights[..., seq_len:].float().sum(dim=-1)  # (B, Hq, T)
            per_head_share = (depth_mass * valid).sum(dim=(0, 2)) / valid.sum(dim=(0, 2)).clamp_min(1.0)
            shares.append(per_head_share if per_head else per_head_share.mean())
        return torch.stack(shares)


class MoDAForCausalLM(MoDAPreTrainedModel, DepthFusionForCausalLM):
    """MoDA with a language-modelling head (``DepthFusionForCausalLM``: ``LlamaForCausalLM``'s forward, generation
    and plans).

    Example:
        >>> from depthfusion_hf import MoDAConfig, MoDAForCausalLM
        >>> model = MoDAForCausalLM(MoDAConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
        >>> model.depth_attention_share(torch.randint(0, 100, (1, 8))).shape
        torch.Size([4])
    """

    base_model_class = MoDAModel

    def depth_attention_share(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, per_head: bool = False
    ) -> torch.Tensor:
        """Per-layer share of attention mass on depth entries, [L] or [L, Hq] (``MoDAModel.depth_attention_share``)."""
        return self.model.depth_attention_share(input_ids, attention_mask=attention_mask, per_head=per_head)


__all__ = ["MoDAForCausalLM", "MoDAModel", "MoDAPreTrainedModel", "MoDADecoderLayer", "MoDAAttention"]
