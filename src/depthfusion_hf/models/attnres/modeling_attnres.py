"""AttnRes: a Llama decoder whose residual sums are Attention Residuals (Kimi Team, arXiv 2603.15031).

Sub-layers l = 1..2L (each attention and each MLP) write outputs v_l; v_0 = the token embedding. A
pre-norm Llama feeds sub-layer l with h_l = v_0 + sum_{i<l} v_i. AttnRes replaces that sum, per token:

    h_l = sum_i alpha_{i,l} s_i,   alpha_{:,l} = softmax_i( w_l . RMSNorm_l(s_i) )   (fp32 softmax)
    v_l = f_l(norm_l(h_l))                      (f_l: the Llama attention or MLP, with its own norm)
    logits = lm_head(norm(h_final)),            h_final: one more AttnRes call over all sources

The sources s_i ("the depth state") are, for *full* AttnRes, v_0..v_{l-1}; for *block* AttnRes with
blocks of S sub-layers, the block sums b_0 = v_0, b_1, .., b_{n-1} of the finished blocks plus the
running sum of the current block (when it has started). Full AttnRes is block AttnRes with S = 1, so
one loop computes both: after sub-layer l the state either appends v_l (l starts a block) or adds v_l
to its last entry. Only those N + 1 tensors are kept.

Each AttnRes call owns a pseudo-query w (zero at init: a uniform average over the sources) and a key
RMSNorm weight (ones). Sub-layer 1 reads the single source v_0, so its call is the identity and is not
materialised; decoder layer i owns the calls that feed its MLP (``mlp_res``) and that form its output
(``output_res``: the next layer's attention input, or h_final after the last layer). So, as in Llama,
the output of layer i is the input of layer i + 1.

The attention, MLP, norms and rotary embeddings are transformers' Llama modules under their Llama
names, so a Llama checkpoint loads by copying weights (``depthfusion_hf.convert.llama_to_attnres``). The
converted model is not exactly the Llama: a uniform average is the residual sum divided by the number of
sources, which every reader's RMSNorm undoes except through its eps (docs/ATTNRES.md measures the shift).
AttnRes is per token, so cached decoding needs only the ordinary KV cache.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .attnres import attention_residual, attention_residual_with_backend, resolve_backend
from .configuration_attnres import AttnResConfig
from .depth_buffer import DepthBuffer, acquire_depth_buffer, uses_depth_buffer
from .shared_sources import (
    attention_residual_from_rows,
    call_keys,
    parameter_versions,
    source_logit_rows,
    uses_logit_rows,
)

# Each model's DepthBuffers, reused from one cached-decoding forward to the next.
DEPTH_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def starts_block(sublayer: int, block_size: int) -> bool:
    """Whether sub-layer ``sublayer`` (1-based) is the first of its block of ``block_size`` sub-layers."""
    return (sublayer - 1) % block_size == 0


def add_to_depth_state(
    sources: tuple[torch.Tensor, ...], output: torch.Tensor, new_block: bool
) -> tuple[torch.Tensor, ...]:
    """The depth state after a sub-layer wrote ``output`` [B, T, D]: a new block sum, or the current one grown."""
    if new_block:
        return (*sources, output)
    return (*sources[:-1], sources[-1] + output)


def num_depth_sources(num_sublayers: int, block_size: int) -> int:
    """The most sources a call reads: the embedding and every sub-layer output (full), or every block sum."""
    return 1 + -(-num_sublayers // block_size)


def grow_depth_state(
    sources: tuple[torch.Tensor, ...], output: torch.Tensor, new_block: bool, buffer: DepthBuffer | None
) -> tuple[torch.Tensor, ...]:
    """:func:`add_to_depth_state`, or (with the forward's :class:`DepthBuffer`) the write into the buffer."""
    if buffer is None:
        return add_to_depth_state(sources, output, new_block)
    buffer.write(output, new_source=new_block)
    return sources


def add_to_row_state(
    rows: tuple[torch.Tensor, ...], sources: tuple[torch.Tensor, ...], new_block: bool, keys: torch.Tensor,
    sublayer: int, block_size: int, eps: float,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The sources' logit rows after sub-layer ``sublayer`` (1-based) wrote into the last of ``sources``, and the
    sources with the last one passed through its row's product (the later calls read that view: the source's
    gradient then meets the row's in one buffer).

    The new row scores the last source for the calls that will read this version of it: every later call
    [B, T, C - sublayer + 1] when the sub-layer ends its block (the source is final), else only the next call
    [B, T, 1] (a running sum the next sub-layer replaces). Call c's column in source j's row is then
    ``c - row_start(j, c, block_size)``.
    """
    ends_block = sublayer % block_size == 0 or sublayer == keys.shape[0]
    last, passed = source_logit_rows(sources[-1], keys[sublayer - 1 :] if ends_block else keys[sublayer - 1 : sublayer],
                                     eps, pass_source=True)
    return ((*rows, last) if new_block else (*rows[:-1], last)), (*sources[:-1], passed)


def row_start(source: int, call: int, block_size: int) -> int:
    """The first call scored by the logit row that call ``call`` (0-based; it feeds sub-layer call + 2) reads
    for its source ``source``: 0 for the embedding, else the call after the last sub-layer written into it."""
    return 0 if source == 0 else min(source * block_size, call + 1) - 1


@dataclass
class LogitRows:
    """What a call needs to run from its sources' logit rows: the rows, its column in each, and the parameters
    its key was taken from with their version counters then (a call whose own parameters are others, e.g.
    swapped in by a wrapper, or were changed in place since, ignores the rows)."""

    rows: tuple[torch.Tensor, ...]
    columns: tuple[int, ...]
    query: torch.Tensor
    key_norm_weight: torch.Tensor
    versions: tuple[int, int]
    # set by a call run from the rows: its sources passed through it, which the later calls read instead
    passed: tuple[torch.Tensor, ...] | None = None

    def current_for(self, query: torch.Tensor, key_norm_weight: torch.Tensor) -> bool:
        """Whether the rows hold the logits of a call with these parameters (the same tensors, unchanged)."""
        return (query is self.query and key_norm_weight is self.key_norm_weight
                and (query._version, key_norm_weight._version) == self.versions)


def calls_readable_ahead(queries: list[torch.Tensor], weights: list[torch.Tensor], hidden_size: int) -> bool:
    """Whether every call's parameters (:func:`call_parameters`: pseudo-queries, key-norm weights) can be read
    before its layer runs, as the shared-source paths do at the start of a forward: plain tensors of shape
    [hidden_size]. Not under FSDP2 or tensor parallelism (sharded DTensors, gathered only inside their layer's
    forward) nor DeepSpeed ZeRO-3 (partitioned parameters are empty until gathered): those forwards take the
    per-call path.
    """
    return all(type(p) in (torch.Tensor, nn.Parameter) and p.shape == (hidden_size,) for p in (*queries, *weights))


def child(module: nn.Module, name: str) -> nn.Module | torch.Tensor:
    """``getattr(module, name)`` for a submodule or parameter of a module, read from nn.Module's own dictionaries
    when it is there (the lookup its ``__getattr__`` makes, at a fraction of the cost: a decoding forward reads
    every call's parameters once)."""
    found = module._modules.get(name)
    if found is None:
        found = module._parameters.get(name)
    return found if found is not None else getattr(module, name)


def call_parameters(calls: list[AttnResMix]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every call's pseudo-query and key-norm weight, in call order: ``(queries, key_norm_weights)``."""
    return [child(mix, "query") for mix in calls], [child(mix, "key_norm_weight") for mix in calls]


class AttnResForwardState:
    """Per-forward bookkeeping the decoder layers share: the op backend resolved once per device, and (when
    asked) the list the layers append every AttnRes call's softmax weights to.

    A plain object on purpose: accelerate's device hooks copy lists and dicts found in a layer's arguments,
    but pass other objects through by reference, so the layers of an offloaded model still share this one.
    """

    def __init__(self, record_weights: bool = False):
        self.backends: dict[torch.device, str] = {}
        self.depth_weights: list[torch.Tensor] | None = [] if record_weights else None
        # With gradients over many tokens (see ``uses_logit_rows``): every call's parameters, in call order, from
        # which the keys were taken; the layers then carry each source's logit rows and the keys next to the
        # sources. Set by the model forward, once.
        self.key_params: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.key_versions: tuple[int, ...] = ()  # their version counters then (queries', then weights')
        # Without gradients over few tokens (cached decoding; see ``uses_depth_buffer``) the sources live here,
        # and the layers pass no source tensors; set by the model forward, once.
        self.buffer: DepthBuffer | None = None

    def backend(self, device: torch.device) -> str:
        """The op backend for ``device``, resolved on first use (``$DEPTHFUSION_BACKEND`` or automatic)."""
        if device not in self.backends:
            self.backends[device] = resolve_backend(None, device)
        return self.backends[device]


# Copied from depthfusion_hf.models.denseformer.modeling_denseformer.check_token_inputs
def check_token_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, vocab_size: int) -> None:
    """Reject decoder inputs the model cannot compute with a ValueError that names the problem.

    Args:
        input_ids: [B, T] integer token ids, or None when ``inputs_embeds`` is given.
        inputs_embeds: [B, T, D] embeddings, or None when ``input_ids`` is given.
        vocab_size: ids must lie in ``[0, vocab_size)``.
    Raises:
        ValueError: unless exactly one of the two is given, it has the shape above with at least one
            token, and (for ids) an integer dtype and every id in range (not checked on the meta device,
            which holds no values). On CUDA an id out of range fails asynchronously instead: a device-side assertion, raised as a RuntimeError at the next sync.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    name, tensor, rank = ("input_ids", input_ids, 2) if input_ids is not None else ("inputs_embeds", inputs_embeds, 3)
    if tensor.dim() != rank:
        layout = "[batch, tokens]" if rank == 2 else "[batch, tokens, hidden]"
        raise ValueError(f"{name} must have shape {layout}; got shape {tuple(tensor.shape)}")
    if tensor.numel() == 0:
        raise ValueError(f"{name} must have at least one token; got shape {tuple(tensor.shape)}")
    if input_ids is None:
        return
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor; got {input_ids.dtype}")
    if input_ids.device.type == "meta":
        return  # no values to check: the meta device only sizes and plans models
    out_of_range = ((input_ids < 0) | (input_ids >= vocab_size)).any()
    if input_ids.device.type == "cuda":
        # No host sync per forward (it would stall every training and decoding step): the check runs on the
        # device and fails the next synchronising call with this message.
        torch._assert_async(~out_of_range, f"input_ids must lie in [0, vocab_size={vocab_size})")
    elif bool(out_of_range):
        raise ValueError(
            f"input_ids must lie in [0, vocab_size={vocab_size}); got min {int(input_ids.min())}, "
            f"max {int(input_ids.max())}"
        )


# Copied from depthfusion_hf.models.denseformer.modeling_denseformer.prepare_decoder_inputs
def prepare_decoder_inputs(
    model: nn.Module,
    input_ids: torch.LongTensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.LongTensor | None,
    cache: Cache | None,
    inputs_embeds: torch.Tensor | None,
    use_cache: bool | None,
) -> tuple[torch.Tensor, torch.LongTensor, Cache | None, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]:
    """The Llama decoder preamble shared by the family models: check and embed the tokens, make the cache,
    positions, causal mask and rotary embeddings.

    Args:
        model: the decoder (with ``config``, ``embed_tokens`` and ``rotary_emb``).
        input_ids: [B, T] token ids (or ``inputs_embeds`` [B, T, D]).
        attention_mask: [B, S] padding mask over cached + new positions (1 = keep).
        position_ids: [B, T]; by default continue from the cache length.
        cache: a transformers ``Cache``; a ``DynamicCache`` is made when none is given and ``use_cache``.
    Returns:
        (inputs_embeds [B, T, D], position_ids [B or 1, T], cache, the causal mask for the layers,
        the rotary (cos, sin), each [B or 1, T, head_dim]).
    """
    check_token_inputs(input_ids, inputs_embeds, model.config.vocab_size)
    if inputs_embeds is None:
        inputs_embeds = model.embed_tokens(input_ids)  # (B, T, D)
    if use_cache and cache is None:
        cache = DynamicCache(config=model.config)
    if position_ids is None:
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
        position_ids = position_ids.unsqueeze(0)

    causal_mask = create_causal_mask(
        config=model.config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
    )
    position_embeddings = model.rotary_emb(inputs_embeds, position_ids=position_ids)
    return inputs_embeds, position_ids, cache, causal_mask, position_embeddings


class AttnResMix(nn.Module):
    """One Attention Residuals call: ``sum_i softmax_i(w . RMSNorm(s_i)) s_i`` over the sources, per token.

    Parameters: ``query`` w [D] (zero at init, so the call starts as a uniform average) and
    ``key_norm_weight`` [D] (the key RMSNorm's weight, ones at init).
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.key_norm_weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self,
        sources: tuple[torch.Tensor, ...] | DepthBuffer,
        backend: str | None = None,
        return_weights: bool = False,
        inv_rms: tuple[torch.Tensor, ...] | None = None,
        logit_rows: LogitRows | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Mix ``sources`` (N tensors [B, T, D]) into h [B, T, D] (and alpha [B, T, N] float32 if asked).

        Args:
            sources: the N sources, or the forward's :class:`DepthBuffer` holding them (the torch backend's
                path without gradients; ``backend`` and ``inv_rms`` are then unused).
            backend: a backend already resolved by ``resolve_backend`` (the model resolves once per forward
                and device); None validates and resolves like the public op.
            return_weights: also return the softmax weights alpha.
            inv_rms: with a resolved backend, optionally ``source_inv_rms`` of each source ([B, T] each).
            logit_rows: with a resolved backend, optionally each source's logit rows (``source_logit_rows``,
                [B, T, C] each) and this call's column: used when this call's parameters are those of the keys.
        """
        if isinstance(sources, DepthBuffer):
            return sources.mix(self.query, self.key_norm_weight, return_weights, self.eps)
        if logit_rows is not None and logit_rows.current_for(self.query, self.key_norm_weight):
            out, logit_rows.passed = attention_residual_from_rows(logit_rows.columns, sources, logit_rows.rows,
                                                                  return_weights, pass_sources=True)
            return out
        if backend is None:
            return attention_residual(self.query, sources, self.key_norm_weight, eps=self.eps,
                                      return_weights=return_weights)
        return attention_residual_with_backend(self.query, sources, self.key_norm_weight, self.eps, return_weights,
                                               backend, inv_rms)

    def extra_repr(self) -> str:
        return f"hidden_size={self.query.numel()}, eps={self.eps}"


class AttnResDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder block whose two residual sums are AttnRes calls (its Llama weights keep their names).

    Differs from Llama: the block reads the depth state (the AttnRes sources) next to its input, mixes its
    MLP input (``mlp_res``) and its output (``output_res``) from that state, and returns the state grown
    by its two sub-layer outputs.
    """

    def __init__(self, config: AttnResConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.layer_idx = layer_idx
        self.block_size = block_size = config.effective_block_size
        self.attn_starts_block = starts_block(2 * layer_idx + 1, block_size)
        self.mlp_starts_block = starts_block(2 * layer_idx + 2, block_size)
        self.mlp_res = AttnResMix(config.hidden_size, config.rms_norm_eps)
        self.output_res = AttnResMix(config.hidden_size, config.rms_norm_eps)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        *sources: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attnres_state: AttnResForwardState | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, ...]:
        """Run the attention and MLP sub-layers.

        Args:
            hidden_states: h, the attention sub-layer's input [B, T, D] (the previous layer's output).
            sources: the depth state h was mixed from, each [B, T, D] (positional, so that reentrant
                gradient checkpointing passes their gradients); when ``attnres_state.key_params`` is set,
                followed by their logit rows (``source_logit_rows``, [B, T, C] each, as many as sources) and
                the keys [C, D] (``call_keys``); none when the state is ``attnres_state.buffer`` (a
                ``DepthBuffer``: no gradients, few tokens).
            attnres_state: the model forward's shared state (resolved backends, the softmax-weight record);
                None (a layer called on its own) lets the public op validate and resolve.
        Returns:
            ``(output, *new_sources)``: the layer output [B, T, D] (the next layer's input, or h_final) and the
            depth state grown by this layer's two sub-layer outputs (then their logit rows and the keys, when
            carried).
        """
        backend = attnres_state.backend(hidden_states.device) if attnres_state is not None else None
        record = attnres_state.depth_weights if attnres_state is not None else None
        buffer = attnres_state.buffer if attnres_state is not None else None
        if buffer is not None and buffer.values.device != hidden_states.device:
            # a layer on another device (device_map): the rest of the forward passes the sources themselves
            sources = tuple(v.to(hidden_states.device) for v in buffer.sources())
            attnres_state.buffer = buffer = None
        key_params = attnres_state.key_params if attnres_state is not None else None
        rows = keys = logit_rows = None
        if key_params is not None:
            n = (len(sources) - 1) // 2
            sources, rows, keys = sources[:n], sources[n : 2 * n], sources[2 * n]
        attn_out, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        sources = grow_depth_state(sources, attn_out, self.attn_starts_block, buffer)
        call = 2 * self.layer_idx  # the call feeding this layer's MLP; 2 i + 1 forms its output
        if rows is not None:
            rows, sources = add_to_row_state(rows, sources, self.attn_starts_block, keys, call + 1, self.block_size,
                                    self.mlp_res.eps)
            logit_rows = self._logit_rows(rows, call, attnres_state)
        # differs from Llama: + attn_out
        hidden_states = self._mix(self.mlp_res, buffer or sources, backend, record, logit_rows)
        sources = logit_rows.passed or sources if logit_rows is not None else sources
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states))
        sources = grow_depth_state(sources, mlp_out, self.mlp_starts_block, buffer)
        if rows is not None:
            rows, sources = add_to_row_state(rows, sources, self.mlp_starts_block, keys, call + 2, self.block_size,
                                    self.output_res.eps)
            logit_rows = self._logit_rows(rows, call + 1, attnres_state)
        # differs from Llama: + mlp_out
        hidden_states = self._mix(self.output_res, buffer or sources, backend, record, logit_rows)
        sources = logit_rows.passed or sources if logit_rows is not None else sources
        return (hidden_states, *sources, *(rows or ()), *(() if keys is None else (keys,)))

    def _logit_rows(self, rows: tuple[torch.Tensor, ...], call: int, state: AttnResForwardState) -> LogitRows:
        """Call ``call``'s view of the rows: its column in each, and the parameters of its key (and versions)."""
        columns = tuple(call - row_start(j, call, self.block_size) for j in range(len(rows)))
        (queries, weights), versions = state.key_params, state.key_versions
        return LogitRows(rows, columns, queries[call], weights[call],
                         (versions[call], versions[len(queries) + call]))

    @staticmethod
    def _mix(mix: AttnResMix, sources, backend: str | None, record: list[torch.Tensor] | None,
             logit_rows: LogitRows | None) -> torch.Tensor:
        """Run one AttnRes call; append its softmax weights to ``record`` when it is a list."""
        if record is None:
            return mix(sources, backend, logit_rows=logit_rows)
        hidden, alpha = mix(sources, backend, return_weights=True, logit_rows=logit_rows)
        record.append(alpha)
        return hidden


class AttnResPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the transformers capabilities shared by AttnRes models."""

    config: AttnResConfig
    config_class = AttnResConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AttnResDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False
    _can_record_outputs = {
        "hidden_states": AttnResDecoderLayer,
        "attentions": LlamaAttention,
    }

    # Copied from depthfusion_hf.models.denseformer.modeling_denseformer.DenseFormerPreTrainedModel.__init__ with DenseFormer->AttnRes  # noqa: E501
    def __init__(self, config: AttnResConfig, *inputs, **kwargs):
        config.check_fields()  # a field changed after construction gets the construction error
        super().__init__(config, *inputs, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, AttnResMix):
            # The paper's init: zero pseudo-queries (uniform averaging), unit key-norm weights. init.* leaves
            # parameters loaded from a checkpoint untouched.
            init.zeros_(module.query)
            init.ones_(module.key_norm_weight)


@dataclass
class AttnResModelOutputWithPast(BaseModelOutputWithPast):
    """``BaseModelOutputWithPast`` plus ``depth_weights``: with ``output_depth_weights=True``, one float32
    tensor [B, T, N_c] per AttnRes call c (sub-layers 2..2L, then the final call), the softmax over its sources.
    """

    depth_weights: tuple[torch.Tensor, ...] | None = None


class AttnResModel(AttnResPreTrainedModel):
    """The AttnRes decoder stack: embeddings, Llama blocks joined by Attention Residuals, final norm.

    Returns ``AttnResModelOutputWithPast`` whose ``last_hidden_state`` is ``norm(h_final)``: [B, T, D].
    With ``output_hidden_states=True`` entry 0 is the embedding and entry i the output of layer i (the
    input of layer i + 1), as for Llama; the last entry is ``last_hidden_state``.
    """

    # Copied from depthfusion_hf.models.moda.modeling_moda.MoDAModel.__init__ with MoDA->AttnRes
    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [AttnResDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    # Copied from depthfusion_hf.models.denseformer.modeling_denseformer.DenseFormerModel.get_input_embeddings
    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    # Copied from depthfusion_hf.models.denseformer.modeling_denseformer.DenseFormerModel.set_input_embeddings
    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
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
        output_depth_weights: bool = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> AttnResModelOutputWithPast:
        """Run the decoder.

        Args:
            input_ids: [B, T] token ids (or ``inputs_embeds`` [B, T, D]).
            attention_mask: [B, S] padding mask over cached + new positions (1 = keep).
            position_ids: [B, T]; by default continue from the cache length.
            cache: a transformers ``Cache`` (``past_key_values`` is accepted as a deprecated alias).
            use_cache: build a ``DynamicCache`` when none is given.
            output_depth_weights: also return every AttnRes call's softmax weights (see
                :class:`AttnResModelOutputWithPast`).
        """
        inputs_embeds, position_ids, cache, causal_mask, position_embeddings = prepare_decoder_inputs(
            self, input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache
        )
        hidden_states = inputs_embeds

        # Differs from Llama: the depth state starts as (v_0,); sub-layer 1's AttnRes over it is v_0 itself.
        sources: tuple[torch.Tensor, ...] = (inputs_embeds,)
        # backends resolved once per device and forward (not per AttnRes call); the softmax weights if asked
        state = AttnResForwardState(record_weights=output_depth_weights)
        backend = state.backend(inputs_embeds.device)
        held = None  # the DepthBuffer this forward holds (released at its end)
        # the shared-source paths read every call's parameters at the start; not possible when they are sharded
        calls = self.attnres_calls()
        params = call_parameters(calls)
        shareable = calls_readable_ahead(*params, inputs_embeds.shape[-1])
        if shareable and uses_depth_buffer(backend, inputs_embeds):  # cached decoding: the sources in one buffer
            state.buffer = held = self.start_depth_buffer(inputs_embeds, calls, params)
            sources = ()
        rows: tuple[torch.Tensor, ...] = ()
        if shareable and uses_logit_rows(backend, inputs_embeds):  # each source scored for every call once
            rows = self.start_logit_rows(inputs_embeds, state, calls, params)
        try:
            hidden_states = self.run_layers(hidden_states, sources, rows, state, causal_mask, position_embeddings,
                                            position_ids, cache, use_cache, **kwargs)
        finally:
            if held is not None:
                held.lock.release()

        hidden_states = self.norm(hidden_states)
        return AttnResModelOutputWithPast(
            last_hidden_state=hidden_states,
            cache=cache,
            depth_weights=tuple(state.depth_weights) if output_depth_weights else None,
        )

    def attnres_calls(self) -> list[AttnResMix]:
        """Every AttnRes call of the decoder in order (each layer's ``mlp_res``, then its ``output_res``)."""
        layers = itertools.islice(self.layers, self.config.num_hidden_layers)  # (slicing builds a ModuleList)
        return [child(layer, name) for layer in layers for name in ("mlp_res", "output_res")]

    def start_depth_buffer(
        self, inputs_embeds: torch.Tensor, calls: list[AttnResMix],
        params: tuple[list[torch.Tensor], list[torch.Tensor]],
    ) -> DepthBuffer:
        """A locked :class:`DepthBuffer` holding the embedding [B, T, D] and the key of every call of ``calls``
        (:meth:`attnres_calls`; ``params``: their :func:`call_parameters`).

        The buffers are kept between forwards (in a module-level weak dictionary, not on the model: copies and
        pickles of the model do not carry them).
        """
        pool = DEPTH_BUFFERS.setdefault(self, [])
        # the calls' eps and the layers' block size (fixed at construction), not the config's now
        buffer = acquire_depth_buffer(pool, inputs_embeds, num_depth_sources(len(calls), self.layers[0].block_size),
                                      len(calls), calls[0].eps)
        buffer.start(inputs_embeds, *params)
        return buffer

    def start_logit_rows(
        self, inputs_embeds: torch.Tensor, state: AttnResForwardState, calls: list[AttnResMix],
        params: tuple[list[torch.Tensor], list[torch.Tensor]],
    ) -> tuple[torch.Tensor, ...]:
        """Take the key of every call of ``calls`` (:meth:`attnres_calls`; ``params``: their
        :func:`call_parameters`) once (``call_keys``) and score the embedding [B, T, D] for every call.

        Returns ``(embedding's logit rows [B, T, C], keys [C, D])`` to pass after the sources, and records the
        parameters of the keys in ``state.key_params`` (their version counters in ``state.key_versions``); ``()``
        (each call scores its own sources) when a call's parameters are not on the embedding's device (e.g.
        offloaded), have no version counter (inference tensors), or the calls' eps differ.
        """
        queries, weights = params
        eps = {mix.eps for mix in calls}
        versions = parameter_versions((*queries, *weights))
        if any(p.device != inputs_embeds.device for p in (*queries, *weights)) or len(eps) != 1 or versions is None:
            return ()
        keys = call_keys(queries, weights, inputs_embeds.dtype)
        state.key_params, state.key_versions = (queries, weights), versions
        return source_logit_rows(inputs_embeds, keys, eps.pop()), keys

    def run_layers(
        self,
        hidden_states: torch.Tensor,
        sources: tuple[torch.Tensor, ...],
        rows: tuple[torch.Tensor, ...],
        state: AttnResForwardState,
        causal_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.LongTensor,
        cache: Cache | None,
        use_cache: bool | None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """The decoder layers over h [B, T, D] and the depth state (``sources``, then ``rows``: their logit rows
        and the keys when ``state.key_params`` is set; or ``state.buffer``); returns h_final [B, T, D]."""
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, *depth = decoder_layer(
                hidden_states,
                *sources,
                *rows,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                attnres_state=state,
                **kwargs,
            )
            if state.key_params is not None:
                n = (len(depth) - 1) // 2
                sources, rows = depth[:n], depth[n:]
            else:
                sources = depth
        return hidden_states

    @torch.no_grad()
    def depth_attention_weights(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        per_token: bool = False,
    ) -> torch.Tensor:
        """Every AttnRes call's softmax over its sources, averaged over the real tokens of a batch.

        Row c is the call feeding sub-layer c + 1 (rows 0..2L-1: sub-layers 1..2L, alternating attention and
        MLP of layers 1..L) and row 2L is the final call before the final norm. Column i is source i: the
        embedding (0) and the sub-layer outputs v_i (full AttnRes) or the block sums b_i, the last column
        of a row being the running sum of the current block (block AttnRes). Row 0 is ``[1, 0, ..]``
        (sub-layer 1 reads the embedding alone). Entries a call does not have are 0 (softmax weights are
        positive, so a 0 means "not a source"); every row sums to 1.

        Args:
            input_ids: [B, T] token ids.
            attention_mask: [B, T], 1 = a real token; padded positions are left out of the average.
            per_token: return the weights of every token instead: [B, T, 2L + 1, N_max].
        Returns:
            [2L + 1, N_max] float32 (``N_max = 2L + 1`` for full AttnRes, ``N + 1`` with N blocks), or
            [B, T, 2L + 1, N_max] with ``per_token=True``.
        """
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


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    """AttnRes with a language-modelling head; works with ``generate()`` and the transformers cache.

    Example:
        >>> from depthfusion_hf import AttnResConfig, AttnResForCausalLM
        >>> model = AttnResForCausalLM(AttnResConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
        ...     num_attention_heads=4, vocab_size=100, attnres_block_size=2))
        >>> model.depth_attention_weights(torch.tensor([[5, 6, 7]])).shape  # 2L + 1 calls, N + 1 = 5 sources
        torch.Size([9, 5])
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    # Copied from depthfusion_hf.models.denseformer.modeling_denseformer.DenseFormerForCausalLM.__init__ with DenseFormer->AttnRes  # noqa: E501
    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = AttnResModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    # Copied from depthfusion_hf.models.denseformer.modeling_denseformer.DenseFormerForCausalLM.get_input_embeddings
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    # Copied from depthfusion_hf.models.denseformer.modeling_denseformer.DenseFormerForCausalLM.set_input_embeddings
    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    # Copied from depthfusion_hf.models.denseformer.modeling_denseformer.DenseFormerForCausalLM.get_output_embeddings
    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    # Copied from depthfusion_hf.models.denseformer.modeling_denseformer.DenseFormerForCausalLM.set_output_embeddings
    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def depth_attention_weights(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        per_token: bool = False,
    ) -> torch.Tensor:
        """See :meth:`AttnResModel.depth_attention_weights`: [2L + 1, N_max] (or per token)."""
        return self.model.depth_attention_weights(input_ids, attention_mask=attention_mask, per_token=per_token)

    # Copied from depthfusion_hf.models.denseformer.modeling_denseformer.DenseFormerForCausalLM.forward
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        """Next-token logits [B, T, V] (and the shifted cross-entropy loss when ``labels`` [B, T] are given)."""
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = [
    "AttnResDecoderLayer",
    "AttnResForCausalLM",
    "AttnResForwardState",
    "AttnResMix",
    "AttnResModel",
    "AttnResModelOutputWithPast",
    "AttnResPreTrainedModel",
]
