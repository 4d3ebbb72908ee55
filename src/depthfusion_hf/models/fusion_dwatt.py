"""The layer-fusion heads of DWAtt: depth-wise attention, Concat, the deeper baseline, ``last`` and ``last_ln``.

Every head maps the encoder's per-token states ``z_0..z_L`` (embedding output, then each layer's output;
``N = L + 1`` tensors [B, T, D]) to one fused state ``h`` [B, T, D] for the token classifier.
``FUSION_HEADS`` (name -> head class) is the one table the config and the model read. The DWAtt equations
(ElNokrashy et al., arXiv 2209.15168) come from a secondary source (a reimplementation citing the paper's
equation numbers); the paper's own code is not public.
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

Fused = tuple[torch.Tensor, torch.Tensor | None]  # (h [B, T, D], depth weights [B, T, N] or None)


def _layer_norm_eps(config: DWAttConfig) -> float:
    return getattr(config.backbone_config, "layer_norm_eps", 1e-5) or 1e-5


class DWAttMLP(nn.Module):
    """The bottleneck MLP of DWAtt: ``f(x) = W LN(GELU(U x))``, [..., in_size] -> [..., out_size]."""

    def __init__(self, in_size: int, bottleneck_size: int, out_size: int, eps: float = 1e-5):
        super().__init__()
        self.up = nn.Linear(in_size, bottleneck_size)  # U
        self.norm = nn.LayerNorm(bottleneck_size, eps=eps)
        self.down = nn.Linear(bottleneck_size, out_size)  # W

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(F.gelu(self.up(x))))


class DWAttFusionHead(nn.Module):
    """The interface of the entries of ``FUSION_HEADS``.

    Class methods (no module built): ``check_config`` raises a ValueError naming an invalid field the head
    reads, ``complete_config`` fills the head's fields left ``None`` at config construction, ``num_params``
    counts the head's parameters (classifier excluded). ``forward(states, attention_mask)`` takes the N states
    [B, T, D] (z_0 first) and the [B, T] mask (1 = real token) and returns ``(h, weights or None)``.
    """

    name: ClassVar[str]

    def __init__(self, config: DWAttConfig):
        super().__init__()

    @classmethod
    def check_config(cls, config: DWAttConfig) -> None:
        pass

    @classmethod
    def complete_config(cls, config: DWAttConfig) -> None:
        cls.check_config(config)

    @classmethod
    def num_params(cls, config: DWAttConfig) -> int:
        raise NotImplementedError

    def forward(self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None) -> Fused:
        raise NotImplementedError


class DWAttDepthAttention(DWAttFusionHead):
    """Depth-wise attention over the ``N = L + 1`` states of each token (secondary-source equations).

        k_n = W_K e_n                    e_n: learned depth embedding [d_pos]
        v_n = LN_n(f_V,n(z_n))           one value MLP and one LayerNorm per state
        q   = 1 + ELU(z_L + f_Q(z_L))    the query comes from the last state only
        a   = softmax_n(q . k_n)         as written: no 1/sqrt(D) scaling
        h   = z_L + sum_n a_n v_n

    Returns ``a`` [B, T, N] as its weights; tokens never see each other here (``attention_mask`` is unused).
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
        check_int("depth_embedding_size", config.depth_embedding_size)
        check_fraction("bottleneck_ratio", config.bottleneck_ratio, allow_zero=False)

    @classmethod
    def num_params(cls, config: DWAttConfig) -> int:
        return dwatt_head_num_params(config.hidden_size, config.num_states, config.bottleneck_size,
                                     config.depth_embedding_size)

    def forward(self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None) -> Fused:
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
    """The Concat baseline: ``h = W_2 LN(GELU(W_1 [z_0; ...; z_L]))`` (assumed form: the paper does not publish
    it), its inner width ``config.concat_hidden_size`` solved from the DWAtt head's parameter count."""

    name = "concat"

    def __init__(self, config: DWAttConfig):
        super().__init__(config)
        self.mlp = DWAttMLP(config.num_states * config.hidden_size, config.concat_hidden_size, config.hidden_size,
                            _layer_norm_eps(config))

    @classmethod
    def check_config(cls, config: DWAttConfig) -> None:
        check_int("concat_hidden_size", config.concat_hidden_size)

    @classmethod
    def complete_config(cls, config: DWAttConfig) -> None:
        if config.concat_hidden_size is None:
            budget = DWAttDepthAttention.num_params(config)
            config.concat_hidden_size = solve_concat_hidden_size(config.hidden_size, config.num_states, budget)
        cls.check_config(config)

    @classmethod
    def num_params(cls, config: DWAttConfig) -> int:
        return concat_head_num_params(config.hidden_size, config.num_states, config.concat_hidden_size)

    def forward(self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None) -> Fused:
        return self.mlp(torch.cat(states, dim=-1)), None  # (B, T, N * D) -> (B, T, D)


class DWAttDeeperFusion(DWAttFusionHead):
    """The deeper-model baseline: ``config.deeper_num_layers`` extra post-LN transformer layers on ``z_L``.

    Assumed form (not published): ``nn.TransformerEncoderLayer`` (GELU, the backbone's dropout) whose FFN width
    ``config.deeper_intermediate_size`` is solved from the DWAtt head's parameter count. Unlike the other heads it
    attends across tokens, honouring the padding mask.
    """

    name = "deeper"

    def __init__(self, config: DWAttConfig):
        super().__init__(config)
        dropout = getattr(config.backbone_config, "hidden_dropout_prob", 0.1) or 0.0
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(config.hidden_size, config.deeper_num_attention_heads,
                                       dim_feedforward=config.deeper_intermediate_size, dropout=dropout,
                                       activation="gelu", layer_norm_eps=_layer_norm_eps(config), batch_first=True)
            for _ in range(config.deeper_num_layers)
        ])

    @classmethod
    def check_config(cls, config: DWAttConfig) -> None:
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
        return deeper_head_num_params(config.hidden_size, config.deeper_intermediate_size, config.deeper_num_layers)

    def forward(self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None) -> Fused:
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
        return 0

    def forward(self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None) -> Fused:
        return states[-1], None


class DWAttLastLayerNorm(DWAttFusionHead):
    """The scale control of ``last``: ``h = LN(z_L)`` (``2 D`` parameters, starting at the identity).

    The fusion heads hand the classifier LayerNorm-ed features (RMS about 1), while an encoder's last layer can
    be much smaller (MiniLM: RMS 0.35 per unit); this head separates that scale effect from depth fusion.
    """

    name = "last_ln"

    def __init__(self, config: DWAttConfig):
        super().__init__(config)
        self.norm = nn.LayerNorm(config.hidden_size, eps=_layer_norm_eps(config))

    @classmethod
    def num_params(cls, config: DWAttConfig) -> int:
        return 2 * config.hidden_size

    def forward(self, states: list[torch.Tensor], attention_mask: torch.Tensor | None = None) -> Fused:
        return self.norm(states[-1]), None


# The fusion heads by config name. DWAtt comes first: the others' sizes are solved from its budget.
FUSION_HEADS: dict[str, type[DWAttFusionHead]] = {
    head.name: head
    for head in (DWAttDepthAttention, DWAttConcatFusion, DWAttLastLayer, DWAttDeeperFusion, DWAttLastLayerNorm)
}

__all__ = ["FUSION_HEADS", "DWAttConcatFusion", "DWAttDeeperFusion", "DWAttDepthAttention", "DWAttFusionHead",
           "DWAttLastLayer", "DWAttLastLayerNorm", "DWAttMLP"]
