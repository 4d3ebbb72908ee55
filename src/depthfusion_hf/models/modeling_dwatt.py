"""DWAtt for token classification: any HF encoder + a layer-fusion head (arXiv 2209.15168).

    z_0..z_L = embedding output and each layer's output of the encoder   (N = L + 1 states, [B, T, D])
    h        = fusion(z_0..z_L)         "dwatt" | "concat" | "deeper" | "last" (h = z_L) | "last_ln" (h = LN(z_L))
    logits   = classifier(dropout(h))   [B, T, num_labels]

The encoder is whatever ``AutoModel.from_config(config.backbone_config)`` builds, so the class it
comes from is transformers' own and the remote-code export needs only this folder. The DWAtt
equations come from a secondary source (see ``fusion_dwatt.py``).
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.modeling_outputs import TokenClassifierOutput
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .configuration_dwatt import DWAttConfig
from .depthfusion_common import CheckedModelMixin, check_token_inputs
from .fusion_dwatt import FUSION_HEADS, DWAttDepthAttention


def check_index_range(name: str, ids: torch.Tensor, limit: int, what: str) -> None:
    """Raise a ValueError naming ``name`` and ``what`` unless ``ids`` is an integer tensor in ``[0, limit)`` (the
    range is an op on CUDA and under ``torch.compile``, as in ``check_token_inputs``; not checked on meta)."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor; got {ids.dtype}")
    if ids.device.type == "meta" or ids.numel() == 0:
        return
    out_of_range = ((ids < 0) | (ids >= limit)).any()
    if ids.device.type == "cuda" or torch.compiler.is_compiling():
        torch._assert_async(~out_of_range, f"{name} must lie in [0, {limit}) ({what})")
    elif bool(out_of_range):
        raise ValueError(f"{name} must lie in [0, {limit}) ({what}); got min {int(ids.min())}, max {int(ids.max())}")


# Where encoders keep their learned absolute position table: BERT-style `embeddings.position_embeddings`, GPT-2's `wpe`.
POSITION_TABLE_NAMES = ("position_embeddings", "wpe")


def position_table(backbone: nn.Module) -> tuple[nn.Module | None, nn.Embedding | None]:
    """``(the module holding it, the table)`` of the encoder's learned absolute positions, or ``(None, None)`` for an
    encoder without one (relative positions only: no length limit here)."""
    for holder in (getattr(backbone, "embeddings", None), backbone):
        for name in POSITION_TABLE_NAMES:
            table = getattr(holder, name, None)
            if isinstance(table, nn.Embedding):
                return holder, table
    return None, None


def check_encoder_inputs(backbone: nn.Module, input_shape: torch.Size, token_type_ids: torch.Tensor | None,
                         position_ids: torch.Tensor | None) -> None:
    """Raise a ValueError naming the limit (not an index error deep inside the backbone) for ``token_type_ids`` /
    ``position_ids`` ([B, T] or None) of another shape than ``input_shape`` (B, T), T above the encoder's position
    limit, or ids outside its position table (:func:`position_table`) or BERT-style ``token_type_embeddings`` (an
    encoder without them, e.g. relative positions only, has no limit here)."""
    embeddings = getattr(backbone, "embeddings", None)
    for name, ids in (("token_type_ids", token_type_ids), ("position_ids", position_ids)):
        if ids is not None and tuple(ids.shape) not in (tuple(input_shape), (1, input_shape[1])):
            raise ValueError(f"{name} must have the inputs' shape {tuple(input_shape)}; got {tuple(ids.shape)}")
    holder, positions = position_table(backbone)
    if positions is not None:
        if position_ids is not None:
            check_index_range("position_ids", position_ids, positions.num_embeddings,
                              "the encoder's max_position_embeddings")
        else:
            # RoBERTa-style encoders number positions from padding_idx + 1 (create_position_ids_from_input_ids).
            offset = holder.padding_idx + 1 if hasattr(holder, "create_position_ids_from_input_ids") else 0
            limit = positions.num_embeddings - offset
            if input_shape[1] > limit:
                raise ValueError(
                    f"the inputs have {input_shape[1]} tokens, more than the encoder takes: at most {limit} "
                    f"(max_position_embeddings = {positions.num_embeddings}"
                    + (f", positions starting at padding_idx + 1 = {offset}" if offset else "")
                    + "); truncate them (tokenizer(..., truncation=True, max_length=...))"
                )
    token_types = getattr(embeddings, "token_type_embeddings", None)
    if token_type_ids is not None and isinstance(token_types, nn.Embedding):
        check_index_range("token_type_ids", token_type_ids, token_types.num_embeddings,
                          "the encoder's type_vocab_size")


def check_token_labels(labels: torch.Tensor, input_shape: torch.Size, num_labels: int) -> None:
    """``labels`` [B, T]: integer class ids in ``[0, num_labels)`` or -100 (ignored); else a ValueError."""
    if tuple(labels.shape) != tuple(input_shape):
        raise ValueError(f"labels must have the inputs' shape {tuple(input_shape)} (one label per token, -100 to "
                         f"ignore one); got {tuple(labels.shape)}")
    check_index_range("labels", labels.masked_fill(labels == -100, 0), num_labels,
                      f"num_labels = {num_labels}, or -100 to ignore a token")


def select_hidden_states(hidden_states: tuple[torch.Tensor, ...], output_hidden_states: bool | int | list[int] | None
                         ) -> tuple[torch.Tensor | None, ...] | None:
    """transformers 5's ``output_hidden_states``: a flag (all states or None), or the index / indices of the states
    to keep (negative ones count from the end; the others become None, out-of-range indices select nothing)."""
    if output_hidden_states is None or isinstance(output_hidden_states, bool):
        return tuple(hidden_states) if output_hidden_states else None
    selected = [output_hidden_states] if isinstance(output_hidden_states, int) else list(output_hidden_states)
    count = len(hidden_states)
    keep = {i % count for i in selected if -count <= i < count}
    return tuple(state if i in keep else None for i, state in enumerate(hidden_states))


@dataclass
class DWAttTokenClassifierOutput(TokenClassifierOutput):
    """``TokenClassifierOutput`` plus the DWAtt depth-attention weights.

    Args:
        depth_attentions (`torch.FloatTensor` [B, T, L + 1], *optional*): per token, the softmax weights
            ``a_n`` over the states ``z_0..z_L`` (each row sums to 1). Returned with
            ``output_depth_attentions=True`` when ``fusion == "dwatt"``; ``None`` otherwise.
    """

    depth_attentions: torch.FloatTensor | None = None


class DWAttPreTrainedModel(CheckedModelMixin, PreTrainedModel):
    """Weight initialisation of the fusion head and classifier; the encoder initialises itself."""

    config: DWAttConfig
    config_class = DWAttConfig
    base_model_prefix = "backbone"
    supports_gradient_checkpointing = True
    # The fusion heads read every layer's output at once: keep each on one device under device_map="auto"
    # (the backbone's own `_no_split_modules` are added by transformers).
    _no_split_modules = ["DWAttDepthAttention", "DWAttConcatFusion", "DWAttDeeperFusion"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        # The backbone is a PreTrainedModel, so transformers dispatches its modules to its own
        # `_init_weights`; this one only sees the head. The `init.*` functions skip parameters that were
        # loaded (flagged `_is_hf_initialized`), so a pretrained backbone or checkpoint is never touched.
        std = self.config.initializer_range or getattr(self.config.backbone_config, "initializer_range", None) or 0.02
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, nn.MultiheadAttention):
            init.normal_(module.in_proj_weight, mean=0.0, std=std)
            init.zeros_(module.in_proj_bias)
        elif isinstance(module, DWAttDepthAttention):
            init.normal_(module.depth_embeddings, mean=0.0, std=std)


class DWAttForTokenClassification(DWAttPreTrainedModel):
    """An encoder with a layer-fusion head and a token classifier.

    ``fusion="last"`` is the ordinary ``*ForTokenClassification`` baseline; ``"dwatt"`` is depth-wise
    attention; ``"concat"`` and ``"deeper"`` are the paper's baselines, sized to the DWAtt head's
    parameter count (``config.fusion_num_params()``).

    Example:
        >>> model = DWAttForTokenClassification.from_pretrained_backbone(
        ...     "path/to/encoder", fusion="dwatt", id2label={0: "O", 1: "B-PER", 2: "I-PER"})
        >>> out = model(**batch, output_depth_attentions=True)
        >>> out.logits.shape, out.depth_attentions.shape  # [B, T, 3], [B, T, L + 1]
    """

    def __init__(self, config: DWAttConfig, backbone: PreTrainedModel | None = None):
        """Build the model; pass ``backbone`` (an ``AutoModel`` matching ``config.backbone_config``) to reuse
        loaded weights, otherwise a randomly initialised one is built from the config."""
        super().__init__(config)  # checks the config
        self.num_labels = config.num_labels
        self.backbone = backbone if backbone is not None else AutoModel.from_config(config.backbone_config)
        if getattr(self.backbone, "pooler", None) is not None:
            self.backbone.pooler = None  # unused by token classification (as in BertForTokenClassification)
        self.fusion = FUSION_HEADS[config.fusion](config)
        dropout = config.classifier_dropout
        if dropout is None:
            dropout = getattr(config.backbone_config, "hidden_dropout_prob", 0.1) or 0.0
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @classmethod
    def from_pretrained_backbone(
        cls,
        pretrained_model_name_or_path: str,
        fusion: str = "dwatt",
        num_labels: int | None = None,
        id2label: dict[int, str] | None = None,
        label2id: dict[str, int] | None = None,
        backbone_kwargs: dict | None = None,
        **config_kwargs,
    ) -> "DWAttForTokenClassification":
        """Load a pretrained encoder (Hub id or folder) with ``AutoModel`` and add a fresh fusion head and classifier.

        ``config_kwargs`` go to ``DWAttConfig`` (e.g. ``depth_embedding_size``, ``classifier_dropout``);
        ``backbone_kwargs`` to ``AutoModel.from_pretrained``. Only the head is initialised.
        """
        backbone = AutoModel.from_pretrained(pretrained_model_name_or_path, **(backbone_kwargs or {}))
        labels: dict = {}
        if id2label is not None:
            labels["id2label"] = {int(i): str(label) for i, label in id2label.items()}
            labels["label2id"] = label2id or {label: int(i) for i, label in id2label.items()}
        elif num_labels is not None:
            labels["num_labels"] = num_labels
        # Keep the backbone's attention implementation: setting the parent's (None by default) would
        # propagate to the sub-config and make the encoder fall back to eager attention.
        config_kwargs.setdefault("attn_implementation", backbone.config._attn_implementation)
        config = DWAttConfig(backbone_config=backbone.config, fusion=fusion, **labels, **config_kwargs)
        return cls(config, backbone=backbone)

    def fusion_num_parameters(self) -> int:
        """Parameters of the fusion head alone (0 for ``"last"``), classifier excluded."""
        return sum(p.numel() for p in self.fusion.parameters())

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        output_depth_attentions: bool | None = None,
        output_hidden_states: bool | int | list[int] | None = None,
        return_dict: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DWAttTokenClassifierOutput | tuple:
        """Token logits [B, T, num_labels] (and the mean cross-entropy over labels != -100 when ``labels`` [B, T]).

        Args:
            input_ids / inputs_embeds: [B, T] ids or [B, T, D] embeddings, as the backbone accepts.
            attention_mask, token_type_ids, position_ids: [B, T]; passed to the backbone when given.
            output_depth_attentions: also return the DWAtt weights [B, T, L + 1] (``fusion == "dwatt"``).
            output_hidden_states: also return the backbone's L + 1 hidden states (True), or those at the given
                index / indices (the others None, as transformers' models do).
            labels: [B, T] class ids in ``[0, num_labels)``, -100 for tokens to ignore.
            kwargs: other backbone arguments (e.g. ``output_attentions``); ``num_items_in_batch``
                (from the ``Trainer``) goes to the loss.
        Raises:
            ValueError: for inputs the model or its encoder cannot compute, or labels of another shape or range.
        """
        check_token_inputs(input_ids, inputs_embeds, self.get_input_embeddings().num_embeddings)
        input_shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        check_encoder_inputs(self.backbone, input_shape, token_type_ids, position_ids)
        if labels is not None:
            check_token_labels(labels, input_shape, self.config.num_labels)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids,
                  "position_ids": position_ids, "inputs_embeds": inputs_embeds}
        inputs = {name: value for name, value in inputs.items() if value is not None}
        outputs = self.backbone(**inputs, output_hidden_states=True, return_dict=True, **kwargs)
        states = list(outputs.hidden_states)  # z_0..z_L, each (B, T, D)
        if len(states) != self.config.num_states:
            raise ValueError(
                f"the backbone returned {len(states)} hidden states; expected num_hidden_layers + 1 = "
                f"{self.config.num_states}"
            )
        states[-1] = outputs.last_hidden_state  # = hidden_states[-1], unless the encoder normalises after it

        fused, weights = self.fusion(states, attention_mask)  # (B, T, D), (B, T, L + 1) or None
        depth_attentions = weights if output_depth_attentions else None
        logits = self.classifier(self.dropout(fused))  # (B, T, num_labels)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config, num_items_in_batch=num_items_in_batch)
        result = DWAttTokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=select_hidden_states(outputs.hidden_states, output_hidden_states),
            attentions=outputs.attentions, depth_attentions=depth_attentions,
        )
        return result if return_dict is not False else result.to_tuple()


__all__ = ["DWAttForTokenClassification", "DWAttPreTrainedModel", "DWAttTokenClassifierOutput"]
