"""The layer-fusion heads of DWAtt: depth-wise attention, Concat, the deeper baseline, and ``last``.

Every head maps the encoder's per-token states ``z_0..z_L`` (embedding output, then each layer's
output; ``N = L + 1`` tensors of shape [B, T, D]) to one fused state ``h`` [B, T, D] that the token
classifier reads. Only DWAtt mixes across depth with attention; no head mixes across tokens except
the deeper baseline (it is a transformer layer).

``FUSION_HEADS`` (name -> head class) is the one table the config and the model read: a head class
validates and completes its own config fields, counts its parameters, and has one forward signature
``forward(states, attention_mask) -> (fused, weights or None)``. A new head is a class plus an entry.

The DWAtt equations are those of ElNokrashy et al. (arXiv 2209.15168), taken from a **secondary source** (a third-party
reimplementation that cites the paper's equation numbers); the paper's own code is not public.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from .sizes_dwatt import (
    check_fraction,
    check_int,
    concat_head_num_params,
    deeper_head_num_params,
    dwatt_head_num_params,
    solve_concat_hidden_size,
    solve_deeper_intermediate_size,
)

if TYPE_CHECKING:
    from .configuration_dwatt import DWAttConfig


def _layer_norm_eps(config: DWAttConfig) -> float:
    return getattr(config.backbone_config, "layer_norm_eps", 1e-5) or 1e-5


class DWAttMLP(nn.Module):
    """The bottleneck MLP of DWAtt: ``f(x) = W LN(GELU(U x))``, ``in_size -> bottleneck -> out_size``."""

    def __init__(self, in_size: int, bottleneck_size: int, out_size: int, eps: float = 1e-5):
        super().__init__()
        self.up = nn.Linear(in_size, bottleneck_size)  # U
        self.norm = nn.LayerNorm(bottleneck_size, eps=eps)
        self.down = nn.Linear(bottleneck_size, out_size)  # W

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_size] -> [..., out_size]."""
        return self.down(self.norm(F.gelu(self.up(x))))


class DWAttFusionHead(nn.Module):
    """The interface of every fusion head (the entries of ``FUSION_HEADS``).

    Class-level (no module built): ``check_config`` validates the config fields the head reads,
    ``complete_config`` fills the ones left ``None`` (sizes solved from the DWAtt head's budget), and
    ``num_params`` counts the head's parameters from the config alone. Instance-level: ``forward``.
    """

    name: ClassVar[str]

    def __init__(self, config: DWAttConfig):
        """Build the head's modules for ``config`` (none by default)."""
        super().__init__()

    @classmethod
    def check_config(cls, config: DWAttConfig) -> None:
        """Raise a ValueError naming the field when a field this head reads is invalid (nothing by default)."""

    @classmethod
    def complete_config(cls, config: DWAttConfig) -> None:
        """Fill this head's fields left ``None`` (nothing by default); run at config construction."""

    @classmethod
    def num_params(cls, config: DWAttConfig) -> int:
        """Parameters of this head for ``config`` (the classifier is not counted)."""
        raise NotImplementedError

    def forward(
        self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fuse ``states`` (N tensors [B, T, D], z_0 first; attention_mask [B, T], 1 = real token).

        Returns ``(h, weights)``: h [B, T, D], and the per-token weights over depth [B, T, N] for heads
        that have them (``None`` otherwise).
        """
        raise NotImplementedError


class DWAttDepthAttention(DWAttFusionHead):
    """Depth-wise attention over the ``N = L + 1`` states of each token (secondary-source equations).

        k_n = W_K e_n                    e_n: learned depth embedding [d_pos]
        v_n = LN_n(f_V,n(z_n))           one value MLP and one LayerNorm per state
        q   = 1 + ELU(z_L + f_Q(z_L))    the query comes from the last state only
        a   = softmax_n(q . k_n)         as written: no 1/sqrt(D) scaling
        h   = z_L + sum_n a_n v_n

    The attention runs over depth for each token separately; tokens never see each other here.
    """

    name = "dwatt"

    def __init__(self, config: DWAttConfig):
        super().__init__(config)
        hidden, states, bottleneck = config.hidden_size, config.num_states, config.bottleneck_size
        eps = _layer_norm_eps(config)
        self.depth_embeddings = nn.Parameter(torch.empty(states, config.depth_embedding_size))  # e_n: (N, d_pos)
        self.key_proj = nn.Linear(config.depth_embedding_size, hidden)  # W_K
        self.query_mlp = DWAttMLP(hidden, bottleneck, hidden, eps)  # f_Q
        self.value_mlps = nn.ModuleList([DWAttMLP(hidden, bottleneck, hidden, eps) for _ in range(states)])
        self.value_norms = nn.ModuleList([nn.LayerNorm(hidden, eps=eps) for _ in range(states)])

    @classmethod
    def check_config(cls, config: DWAttConfig) -> None:
        """``depth_embedding_size`` >= 1 and ``bottleneck_ratio`` in (0, 1]."""
        check_int("depth_embedding_size", config.depth_embedding_size)
        check_fraction("bottleneck_ratio", config.bottleneck_ratio, allow_zero=False)

    @classmethod
    def complete_config(cls, config: DWAttConfig) -> None:
        """Nothing to fill; validates the fields the budget (read by the other heads) depends on."""
        cls.check_config(config)

    @classmethod
    def num_params(cls, config: DWAttConfig) -> int:
        """The DWAtt head's count: the budget the baselines are sized to."""
        return dwatt_head_num_params(config.hidden_size, config.num_states, config.bottleneck_size,
                                     config.depth_embedding_size)

    def forward(
        self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fuse ``states`` (N tensors [B, T, D], z_0 first) into ``h`` [B, T, D]; also return ``a`` [B, T, N].

        ``attention_mask`` is unused: each token attends over its own depth only.
        """
        last = states[-1]  # z_L: (B, T, D)
        query = 1.0 + F.elu(last + self.query_mlp(last))  # (B, T, D), entries > 0
        keys = self.key_proj(self.depth_embeddings)  # (N, D)
        weights = torch.softmax(torch.matmul(query, keys.transpose(0, 1)), dim=-1)  # (B, T, N)
        values = torch.stack(
            [norm(mlp(z)) for z, mlp, norm in zip(states, self.value_mlps, self.value_norms, strict=True)], dim=-2
        )  # (B, T, N, D)
        fused = last + torch.matmul(weights.unsqueeze(-2), values).squeeze(-2)  # (B, T, D)
        return fused, weights


class DWAttConcatFusion(DWAttFusionHead):
    """The Concat baseline: ``h = W_2 LN(GELU(W_1 [z_0; ...; z_L]))``.

    The paper concatenates the per-token layer outputs and projects them back to D; the exact head is
    not published (assumed here). Its inner width ``config.concat_hidden_size`` is solved from the
    DWAtt head's parameter count, so both heads have a similar budget.
    """

    name = "concat"

    def __init__(self, config: DWAttConfig):
        super().__init__(config)
        self.mlp = DWAttMLP(config.num_states * config.hidden_size, config.concat_hidden_size, config.hidden_size,
                            _layer_norm_eps(config))

    @classmethod
    def check_config(cls, config: DWAttConfig) -> None:
        """``concat_hidden_size`` is an integer >= 1 (``None`` only before ``complete_config``)."""
        check_int("concat_hidden_size", config.concat_hidden_size)

    @classmethod
    def complete_config(cls, config: DWAttConfig) -> None:
        """Solve ``concat_hidden_size`` from the DWAtt head's budget when it is ``None``."""
        if config.concat_hidden_size is None:
            budget = DWAttDepthAttention.num_params(config)
            config.concat_hidden_size = solve_concat_hidden_size(config.hidden_size, config.num_states, budget)
        cls.check_config(config)

    @classmethod
    def num_params(cls, config: DWAttConfig) -> int:
        """``(L + 1) D m + 3 m + m D + D`` with inner width m."""
        return concat_head_num_params(config.hidden_size, config.num_states, config.concat_hidden_size)

    def forward(
        self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        """N tensors [B, T, D] -> (h [B, T, D], None); ``attention_mask`` is unused (per-token head)."""
        return self.mlp(torch.cat(states, dim=-1)), None  # (B, T, N * D) -> (B, T, D)


class DWAttDeeperFusion(DWAttFusionHead):
    """The deeper-model baseline: ``config.deeper_num_layers`` extra post-LN transformer layers on ``z_L``.

    Assumed form (the paper does not publish it): standard encoder layers (``nn.TransformerEncoderLayer``,
    GELU, the backbone's dropout) whose FFN width ``config.deeper_intermediate_size`` is solved from the
    DWAtt head's parameter count. Unlike the fusion heads it attends across tokens, honouring padding.
    """

    name = "deeper"

    def __init__(self, config: DWAttConfig):
        super().__init__(config)
        dropout = getattr(config.backbone_config, "hidden_dropout_prob", 0.1) or 0.0
        self.layers = nn.ModuleList(
            [
                nn.TransformerEncoderLayer(
                    config.hidden_size,
                    config.deeper_num_attention_heads,
                    dim_feedforward=config.deeper_intermediate_size,
                    dropout=dropout,
                    activation="gelu",
                    layer_norm_eps=_layer_norm_eps(config),
                    batch_first=True,
                )
                for _ in range(config.deeper_num_layers)
            ]
        )

    @classmethod
    def check_config(cls, config: DWAttConfig) -> None:
        """``deeper_num_layers``, ``deeper_intermediate_size`` >= 1; ``deeper_num_attention_heads`` divides D."""
        check_int("deeper_num_layers", config.deeper_num_layers)
        check_int("deeper_intermediate_size", config.deeper_intermediate_size)
        heads = config.deeper_num_attention_heads
        check_int("deeper_num_attention_heads", heads)
        if config.hidden_size % heads != 0:
            raise ValueError(
                f"`deeper_num_attention_heads` ({heads}) must divide the backbone's `hidden_size` "
                f"({config.hidden_size})"
            )

    @classmethod
    def complete_config(cls, config: DWAttConfig) -> None:
        """Take the backbone's head count and solve the FFN width from the DWAtt head's budget when ``None``."""
        check_int("deeper_num_layers", config.deeper_num_layers)
        if config.deeper_num_attention_heads is None:
            config.deeper_num_attention_heads = getattr(config.backbone_config, "num_attention_heads", 1)
        if config.deeper_intermediate_size is None:
            budget = DWAttDepthAttention.num_params(config)
            config.deeper_intermediate_size = solve_deeper_intermediate_size(
                config.hidden_size, budget, config.deeper_num_layers
            )
        cls.check_config(config)

    @classmethod
    def num_params(cls, config: DWAttConfig) -> int:
        """``deeper_num_layers`` x (attention ``4 D^2 + 4 D`` + FFN + two LayerNorms)."""
        return deeper_head_num_params(config.hidden_size, config.deeper_intermediate_size, config.deeper_num_layers)

    def forward(
        self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        """Run the extra layers on z_L = states[-1] [B, T, D], ignoring positions where attention_mask is 0."""
        padding = None if attention_mask is None else attention_mask == 0  # (B, T), True = ignore
        hidden = states[-1]
        for layer in self.layers:
            hidden = layer(hidden, src_key_padding_mask=padding)
        return hidden, None


class DWAttLastLayer(DWAttFusionHead):
    """The ordinary token-classification baseline: ``h = z_L``, no parameters."""

    name = "last"

    @classmethod
    def num_params(cls, config: DWAttConfig) -> int:
        """0: the head has no parameters."""
        return 0

    def forward(
        self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        """(z_L = states[-1] [B, T, D], None)."""
        return states[-1], None


class DWAttLastLayerNorm(DWAttFusionHead):
    """The scale control of the ``last`` baseline: ``h = LN(z_L)``, a LayerNorm on the last state only.

    The fusion heads hand the classifier LayerNorm-ed features (RMS about 1), while an encoder's last
    layer can be much smaller (MiniLM: RMS 0.35 per unit). This head gives ``last`` the same scale and
    conditioning without reading any other layer, so that it separates the scale effect from depth
    fusion. Its affine starts at the identity (scale 1, shift 0); ``2 D`` parameters.
    """

    name = "last_ln"

    def __init__(self, config: DWAttConfig):
        super().__init__(config)
        self.norm = nn.LayerNorm(config.hidden_size, eps=_layer_norm_eps(config))

    @classmethod
    def num_params(cls, config: DWAttConfig) -> int:
        """``2 D``: the LayerNorm's scale and shift."""
        return 2 * config.hidden_size

    def forward(
        self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        """(LN(z_L) [B, T, D] with z_L = states[-1], None); ``attention_mask`` is unused (per-token head)."""
        return self.norm(states[-1]), None


# The fusion heads by config name. DWAtt comes first: the others' sizes are solved from its budget.
FUSION_HEADS: dict[str, type[DWAttFusionHead]] = {
    head.name: head
    for head in (DWAttDepthAttention, DWAttConcatFusion, DWAttLastLayer, DWAttDeeperFusion, DWAttLastLayerNorm)
}


__all__ = [
    "FUSION_HEADS",
    "DWAttConcatFusion",
    "DWAttDeeperFusion",
    "DWAttDepthAttention",
    "DWAttFusionHead",
    "DWAttLastLayer",
    "DWAttLastLayerNorm",
    "DWAttMLP",
]
