"""DWAtt configuration: any Hugging Face encoder (as a sub-config) plus a layer-fusion head.

Each head of ``FUSION_HEADS`` (``fusion_dwatt.py``) validates and completes its own fields, so that the config
sizes the ``concat`` and ``deeper`` baselines to the DWAtt head's budget and stores the widths in ``config.json``.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig
from transformers.configuration_utils import PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .fusion_dwatt import FUSION_HEADS
from .sizes_dwatt import check_fraction, concat_head_num_params, deeper_head_num_params, dwatt_head_num_params  # noqa: F401
from .transformers_compat import SubConfigSpec, build_sub_config

FUSION_METHODS = tuple(FUSION_HEADS)  # ("dwatt", "concat", "last", "deeper", "last_ln")
_BACKBONE_HINT = "pass the encoder's config, e.g. BertConfig(...) or {'model_type': 'bert', ...}"


def check_backbone_dict(backbone: object) -> None:
    """Allow ``None`` (BERT defaults), a ``PreTrainedConfig`` other than a ``DWAttConfig``, or a dict whose
    ``model_type`` transformers knows (not ``"dwatt"``); checked before transformers builds the sub-config."""
    if backbone is None:
        return
    if isinstance(backbone, dict):
        model_type = backbone.get("model_type")
        if model_type is None:
            raise ValueError("`backbone_config` given as a dict must contain `model_type` (e.g. 'bert')")
        if model_type == DWAttConfig.model_type:
            raise ValueError(f"`backbone_config` cannot be a DWAtt config (model_type 'dwatt'); {_BACKBONE_HINT}")
        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            raise ValueError(
                f"`backbone_config` has an unknown model_type {model_type!r}: transformers has no config class "
                f"for it (known encoders include 'bert', 'roberta', 'xlm-roberta', 'deberta-v2')"
            )
        return
    if isinstance(backbone, DWAttConfig):
        raise ValueError(f"`backbone_config` cannot be a DWAttConfig (a DWAtt model is not an encoder); "
                         f"{_BACKBONE_HINT}")
    if not isinstance(backbone, PreTrainedConfig):
        raise ValueError(
            f"`backbone_config` must be None, a dict with `model_type` or a PreTrainedConfig; "
            f"got {type(backbone).__name__}"
        )


def check_no_backbone_shape_kwargs(kwargs: dict) -> None:
    """Reject ``hidden_size`` / ``num_hidden_layers`` given to ``DWAttConfig`` itself: they are the encoder's."""
    for name in ("hidden_size", "num_hidden_layers"):
        if name in kwargs:
            raise ValueError(
                f"`{name}` ({kwargs[name]!r}) belongs to the encoder: set it in `backbone_config` (e.g. "
                f"DWAttConfig(backbone_config=BertConfig({name}=..., ...))); to add a DWAtt head to a pretrained "
                f"encoder use DWAttForTokenClassification.from_pretrained_backbone(path) (or from_pretrained(path) "
                f"on the encoder's folder)"
            )


def check_labels(config: PreTrainedConfig, num_labels: object = None) -> None:
    """``num_labels`` (when given) is an integer >= 1 and ``id2label`` maps exactly the classes ``0..num_labels-1``."""
    if num_labels is not None and (isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1):
        raise ValueError(f"`num_labels` must be an integer >= 1; got {num_labels!r}")
    id2label = config.id2label or {}
    if len(id2label) < 1:
        raise ValueError("`num_labels` must be an integer >= 1; `id2label` has no entries")
    keys = sorted(int(key) for key in id2label)
    if keys != list(range(len(keys))):
        raise ValueError(
            f"`id2label` must map each class index 0..{len(keys) - 1} (num_labels = {len(keys)}) exactly once; "
            f"got the indices {keys}"
        )


def check_backbone_shape(backbone: PreTrainedConfig) -> None:
    """The built backbone config has integer ``hidden_size`` and ``num_hidden_layers`` >= 1."""
    for name in ("hidden_size", "num_hidden_layers"):
        value = getattr(backbone, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            found = "has no" if value is None else f"has an invalid ({value!r})"
            raise ValueError(
                f"`backbone_config` ({type(backbone).__name__}, model_type {backbone.model_type!r}) {found} "
                f"`{name}`; the DWAtt heads need an encoder config with integer `hidden_size` and "
                f"`num_hidden_layers` >= 1"
            )


@strict
class DWAttConfig(PreTrainedConfig):
    r"""Configuration of ``DWAttForTokenClassification`` (DWAtt, ElNokrashy et al., arXiv 2209.15168).

    An encoder that ``AutoModel`` builds (BERT, RoBERTa, XLM-R, DeBERTa, MiniLM, ...) held as the
    sub-config ``backbone_config``, and a head that fuses, per token, the embedding output and every
    layer's output (``L + 1`` states) before the token classifier.

    Args:
        backbone_config (`dict` or `PreTrainedConfig`, *optional*): the encoder's config; a dict
            needs ``model_type``. Defaults to ``BertConfig()``.
        fusion (`str`, defaults to ``"dwatt"``): one of ``"dwatt"`` (depth-wise attention),
            ``"concat"`` (concatenate the L + 1 states, then an MLP), ``"last"`` (the ordinary
            last-layer baseline, no fusion parameters), ``"deeper"`` (extra transformer layers on
            top, the paper's deeper-model baseline) or ``"last_ln"`` (``last`` with a LayerNorm on
            z_L: the scale control).
        depth_embedding_size (`int`, defaults to 24): ``d_pos``, width of the learned depth
            embeddings ``e_n`` from which DWAtt's keys are projected.
        bottleneck_ratio (`float`, defaults to 0.5): ``gamma``; DWAtt's MLPs are ``D -> gamma D -> D``.
        concat_hidden_size (`int`, *optional*): inner width of the Concat MLP. ``None`` solves it
            so the Concat head has as many parameters as the DWAtt head.
        deeper_num_layers (`int`, defaults to 1): number of extra layers of the deeper baseline.
        deeper_intermediate_size (`int`, *optional*): FFN width of those layers; ``None`` solves it
            from the DWAtt head's parameter count.
        deeper_num_attention_heads (`int`, *optional*): heads of the extra layers; ``None`` takes
            the backbone's ``num_attention_heads``.
        classifier_dropout (`float`, *optional*): dropout before the classifier; ``None`` takes the
            backbone's ``hidden_dropout_prob`` (0.1 when it has none).
        initializer_range (`float`, *optional*): std of the head's normal init; ``None`` takes the
            backbone's (0.02 when it has none).

    Example:
        >>> from transformers import BertConfig
        >>> config = DWAttConfig(backbone_config=BertConfig(hidden_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, intermediate_size=128), fusion="concat", num_labels=5)
        >>> config.concat_hidden_size  # solved from the DWAtt head's budget
        73
    """

    model_type = "dwatt"
    if SubConfigSpec is not None:
        sub_configs_defaults = {"backbone_config": SubConfigSpec(config_class=AutoConfig, model_type="bert")}
    else:  # transformers < 5.20: __post_init__ builds the backbone config (build_sub_config)
        sub_configs = {"backbone_config": AutoConfig}

    backbone_config: dict | PreTrainedConfig | None = None
    fusion: str = "dwatt"
    depth_embedding_size: int = 24
    bottleneck_ratio: float = 0.5
    concat_hidden_size: int | None = None
    deeper_num_layers: int = 1
    deeper_intermediate_size: int | None = None
    deeper_num_attention_heads: int | None = None
    classifier_dropout: float | None = None
    initializer_range: float | None = None

    def __post_init__(self, **kwargs):
        check_backbone_dict(self.backbone_config)
        self.backbone_config = build_sub_config(self.backbone_config, default_model_type="bert")
        check_no_backbone_shape_kwargs(kwargs)
        num_labels = kwargs.get("num_labels")
        # Builds self.backbone_config from a dict / None, then sets the other kwargs; a top-level vocab_size (written
        # by resize_token_embeddings before get_text_config named the backbone) goes to the backbone's.
        super().__post_init__(**kwargs)
        check_backbone_shape(self.backbone_config)
        check_labels(self, num_labels)
        for head in FUSION_HEADS.values():  # DWAtt first: the others solve their sizes from its budget
            head.complete_config(self)
        self.check_fields()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Build from a dict; the config of a plain encoder (``model_type`` another than ``"dwatt"``, e.g. read by
        ``DWAttForTokenClassification.from_pretrained`` from a BERT folder) becomes the backbone of a default DWAtt
        config, so that the encoder's weights load under ``backbone.`` and the head is initialised."""
        model_type = config_dict.get("model_type")
        if model_type is not None and model_type != cls.model_type:  # checked as a backbone_config by __post_init__
            config_dict = {"backbone_config": dict(config_dict)}
        return super().from_dict(config_dict, **kwargs)

    def get_text_config(self, decoder=None, encoder=None) -> PreTrainedConfig:
        """The encoder's config: the text side of the model (``resize_token_embeddings`` writes its vocab_size)."""
        return self.backbone_config

    def check_fields(self) -> None:
        """Raise a ValueError naming an invalid field; also run when a model is built (a field changed after
        construction gets the same error). Every head's fields are checked: all their sizes are stored."""
        if self.fusion not in FUSION_HEADS:
            raise ValueError(f"`fusion` must be one of {list(FUSION_METHODS)}; got {self.fusion!r}")
        check_backbone_dict(self.backbone_config)
        check_backbone_shape(self.backbone_config)
        check_labels(self)
        for head in FUSION_HEADS.values():
            head.check_config(self)
        if self.classifier_dropout is not None:
            check_fraction("classifier_dropout", self.classifier_dropout, allow_zero=True)
        std = self.initializer_range
        if std is not None and (isinstance(std, bool) or not isinstance(std, (int, float)) or not std > 0):
            raise ValueError(f"`initializer_range` must be a number > 0; got {self.initializer_range!r}")

    @property
    def hidden_size(self) -> int:  # D, the backbone's (and the fused state's) width
        return self.backbone_config.hidden_size

    @property
    def num_hidden_layers(self) -> int:  # L, the backbone's
        return self.backbone_config.num_hidden_layers

    @property
    def vocab_size(self) -> int:  # the backbone's (resize_token_embeddings sets it)
        return self.backbone_config.vocab_size

    @vocab_size.setter
    def vocab_size(self, value: int) -> None:
        self.backbone_config.vocab_size = value

    @property
    def num_states(self) -> int:  # L + 1: the embedding output and each layer's output
        return self.backbone_config.num_hidden_layers + 1

    @property
    def bottleneck_size(self) -> int:  # DWAtt's MLP bottleneck width max(1, round(gamma D))
        return max(1, round(self.bottleneck_ratio * self.hidden_size))

    def fusion_num_params(self, fusion: str | None = None) -> int:
        """Parameters of a fusion head (``fusion`` defaults to this config's), classifier excluded."""
        fusion = self.fusion if fusion is None else fusion
        if fusion not in FUSION_HEADS:
            raise ValueError(f"`fusion` must be one of {list(FUSION_METHODS)}; got {fusion!r}")
        return FUSION_HEADS[fusion].num_params(self)


__all__ = ["DWAttConfig", "FUSION_METHODS"]
