"""DWAtt configuration: any Hugging Face encoder (as a sub-config) plus a layer-fusion head.

The parameter-count arithmetic of the fusion heads lives here too (plain integers, no torch), so
that the config can size the ``concat`` and ``deeper`` baselines to the DWAtt head's budget when it
is built, and store the chosen widths in ``config.json``.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig
from transformers.configuration_utils import PreTrainedConfig, SubConfigSpec

FUSION_METHODS = ("dwatt", "concat", "last", "deeper")


def dwatt_head_num_params(hidden_size: int, num_states: int, bottleneck_size: int, depth_embedding_size: int) -> int:
    """Parameters of the DWAtt head (``DWAttDepthAttention``) for width D and ``num_states`` = L + 1.

    ``f(x) = W LN(GELU(U x))`` costs ``2 D b + 3 b + D`` with bottleneck ``b``; the head has one ``f``
    per state (values) plus one for the query, an output LayerNorm per state (``2 D`` each), the
    depth embeddings ``(L + 1) x d_pos`` and the key projection ``W_K`` (``d_pos D + D``).
    """
    mlp = 2 * hidden_size * bottleneck_size + 3 * bottleneck_size + hidden_size
    values = num_states * (mlp + 2 * hidden_size)
    keys = num_states * depth_embedding_size + depth_embedding_size * hidden_size + hidden_size
    return values + mlp + keys


def concat_head_num_params(hidden_size: int, num_states: int, concat_hidden_size: int) -> int:
    """Parameters of the Concat head: ``W_2 LN(GELU(W_1 [z_0; ...; z_L]))`` with inner width ``m``."""
    m = concat_hidden_size
    return num_states * hidden_size * m + m + 2 * m + m * hidden_size + hidden_size


def deeper_head_num_params(hidden_size: int, intermediate_size: int, num_layers: int = 1) -> int:
    """Parameters of ``num_layers`` post-LN transformer layers (attention + FFN of width ``intermediate_size``)."""
    attention = 4 * hidden_size * hidden_size + 4 * hidden_size
    ffn = 2 * hidden_size * intermediate_size + intermediate_size + hidden_size
    norms = 4 * hidden_size
    return num_layers * (attention + ffn + norms)


def solve_concat_hidden_size(hidden_size: int, num_states: int, budget: int) -> int:
    """The Concat inner width ``m >= 1`` whose head size is closest to ``budget`` parameters."""
    per_unit = num_states * hidden_size + 3 + hidden_size
    return max(1, round((budget - hidden_size) / per_unit))


def solve_deeper_intermediate_size(hidden_size: int, budget: int, num_layers: int = 1) -> int:
    """The FFN width ``>= 1`` of the deeper baseline whose size is closest to ``budget`` parameters.

    When even a width-1 FFN exceeds the budget (attention alone is too big) this returns 1; the
    budget check in ``DWAttConfig`` then reports the mismatch.
    """
    fixed = num_layers * (4 * hidden_size * hidden_size + 4 * hidden_size + hidden_size + 4 * hidden_size)
    per_unit = num_layers * (2 * hidden_size + 1)
    return max(1, round((budget - fixed) / per_unit))


def _check_int(name: str, value, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an integer >= {low}; got {value!r}")


def _check_fraction(name: str, value, allow_zero: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (0.0 <= value < 1.0 if allow_zero else 0.0 < value <= 1.0)
    if not ok:
        interval = "[0, 1)" if allow_zero else "(0, 1]"
        raise ValueError(f"`{name}` must be a number in {interval}; got {value!r}")


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
            last-layer baseline, no fusion parameters) or ``"deeper"`` (extra transformer layers on
            top, the paper's deeper-model baseline).
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
    sub_configs_defaults = {"backbone_config": SubConfigSpec(config_class=AutoConfig, model_type="bert")}

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
        if isinstance(self.backbone_config, dict) and "model_type" not in self.backbone_config:
            raise ValueError("`backbone_config` given as a dict must contain `model_type` (e.g. 'bert')")
        if self.fusion not in FUSION_METHODS:
            raise ValueError(f"`fusion` must be one of {list(FUSION_METHODS)}; got {self.fusion!r}")
        _check_int("depth_embedding_size", self.depth_embedding_size)
        _check_fraction("bottleneck_ratio", self.bottleneck_ratio, allow_zero=False)
        _check_int("deeper_num_layers", self.deeper_num_layers)
        for name in ("concat_hidden_size", "deeper_intermediate_size", "deeper_num_attention_heads"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        if self.classifier_dropout is not None:
            _check_fraction("classifier_dropout", self.classifier_dropout, allow_zero=True)
        if self.initializer_range is not None and not (
            isinstance(self.initializer_range, (int, float)) and self.initializer_range > 0
        ):
            raise ValueError(f"`initializer_range` must be a number > 0; got {self.initializer_range!r}")
        super().__post_init__(**kwargs)  # builds self.backbone_config from a dict / None

        hidden = self.backbone_config.hidden_size
        _check_int("backbone_config.hidden_size", hidden)
        _check_int("backbone_config.num_hidden_layers", self.backbone_config.num_hidden_layers)
        if self.deeper_num_attention_heads is None:
            self.deeper_num_attention_heads = getattr(self.backbone_config, "num_attention_heads", 1)
        if hidden % self.deeper_num_attention_heads != 0:
            raise ValueError(
                f"`deeper_num_attention_heads` ({self.deeper_num_attention_heads}) must divide the backbone's "
                f"`hidden_size` ({hidden})"
            )
        budget = self.dwatt_head_num_params()
        if self.concat_hidden_size is None:
            self.concat_hidden_size = solve_concat_hidden_size(hidden, self.num_states, budget)
        if self.deeper_intermediate_size is None:
            self.deeper_intermediate_size = solve_deeper_intermediate_size(hidden, budget, self.deeper_num_layers)

    @property
    def hidden_size(self) -> int:
        """The backbone's width D (also the width of the fused state)."""
        return self.backbone_config.hidden_size

    @property
    def num_states(self) -> int:
        """L + 1: the embedding output and the output of each of the backbone's L layers."""
        return self.backbone_config.num_hidden_layers + 1

    @property
    def bottleneck_size(self) -> int:
        """DWAtt's MLP bottleneck width ``max(1, round(gamma D))``."""
        return max(1, round(self.bottleneck_ratio * self.hidden_size))

    def dwatt_head_num_params(self) -> int:
        """Parameters of the DWAtt fusion head for this backbone (the budget the baselines are sized to)."""
        return dwatt_head_num_params(self.hidden_size, self.num_states, self.bottleneck_size,
                                     self.depth_embedding_size)

    def fusion_num_params(self, fusion: str | None = None) -> int:
        """Parameters of a fusion head (``fusion`` defaults to this config's), classifier excluded."""
        fusion = self.fusion if fusion is None else fusion
        if fusion == "dwatt":
            return self.dwatt_head_num_params()
        if fusion == "concat":
            return concat_head_num_params(self.hidden_size, self.num_states, self.concat_hidden_size)
        if fusion == "deeper":
            return deeper_head_num_params(self.hidden_size, self.deeper_intermediate_size, self.deeper_num_layers)
        if fusion == "last":
            return 0
        raise ValueError(f"`fusion` must be one of {list(FUSION_METHODS)}; got {fusion!r}")


__all__ = ["DWAttConfig", "FUSION_METHODS"]
