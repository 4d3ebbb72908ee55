"""The layer-fusion heads of DWAtt: depth-wise attention, Concat, the deeper baseline, and ``last``.

Every head maps the encoder's per-token states ``z_0..z_L`` (embedding output, then each layer's
output; ``N = L + 1`` tensors of shape [B, T, D]) to one fused state ``h`` [B, T, D] that the token
classifier reads. Only DWAtt mixes across depth with attention; no head mixes across tokens except
the deeper baseline (it is a transformer layer).

The DWAtt equations are those of PAPERS.md §3, taken from a **secondary source** (a third-party
reimplementation that cites the paper's equation numbers); the paper's own code is not public.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

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


class DWAttDepthAttention(nn.Module):
    """Depth-wise attention over the ``N = L + 1`` states of each token (secondary-source equations).

        k_n = W_K e_n                    e_n: learned depth embedding [d_pos]
        v_n = LN_n(f_V,n(z_n))           one value MLP and one LayerNorm per state
        q   = 1 + ELU(z_L + f_Q(z_L))    the query comes from the last state only
        a   = softmax_n(q . k_n)         as written: no 1/sqrt(D) scaling
        h   = z_L + sum_n a_n v_n

    The attention runs over depth for each token separately; tokens never see each other here.
    """

    def __init__(self, config: DWAttConfig):
        super().__init__()
        hidden, states, bottleneck = config.hidden_size, config.num_states, config.bottleneck_size
        eps = _layer_norm_eps(config)
        self.depth_embeddings = nn.Parameter(torch.empty(states, config.depth_embedding_size))  # e_n: (N, d_pos)
        self.key_proj = nn.Linear(config.depth_embedding_size, hidden)  # W_K
        self.query_mlp = DWAttMLP(hidden, bottleneck, hidden, eps)  # f_Q
        self.value_mlps = nn.ModuleList([DWAttMLP(hidden, bottleneck, hidden, eps) for _ in range(states)])
        self.value_norms = nn.ModuleList([nn.LayerNorm(hidden, eps=eps) for _ in range(states)])

    def forward(self, states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Fuse ``states`` (N tensors [B, T, D], z_0 first) into ``h`` [B, T, D]; also return ``a`` [B, T, N]."""
        last = states[-1]  # z_L: (B, T, D)
        query = 1.0 + F.elu(last + self.query_mlp(last))  # (B, T, D), entries > 0
        keys = self.key_proj(self.depth_embeddings)  # (N, D)
        weights = torch.softmax(torch.matmul(query, keys.transpose(0, 1)), dim=-1)  # (B, T, N)
        values = torch.stack(
            [norm(mlp(z)) for z, mlp, norm in zip(states, self.value_mlps, self.value_norms, strict=True)], dim=-2
        )  # (B, T, N, D)
        fused = last + torch.matmul(weights.unsqueeze(-2), values).squeeze(-2)  # (B, T, D)
        return fused, weights


class DWAttConcatFusion(nn.Module):
    """The Concat baseline: ``h = W_2 LN(GELU(W_1 [z_0; ...; z_L]))``.

    The paper concatenates the per-token layer outputs and projects them back to D; the exact head is
    not published (assumed here). Its inner width ``config.concat_hidden_size`` is solved from the
    DWAtt head's parameter count, so both heads have a similar budget.
    """

    def __init__(self, config: DWAttConfig):
        super().__init__()
        self.mlp = DWAttMLP(config.num_states * config.hidden_size, config.concat_hidden_size, config.hidden_size,
                            _layer_norm_eps(config))

    def forward(self, states: list[torch.Tensor]) -> torch.Tensor:
        """N tensors [B, T, D] -> [B, T, D]."""
        return self.mlp(torch.cat(states, dim=-1))  # (B, T, N * D) -> (B, T, D)


class DWAttDeeperFusion(nn.Module):
    """The deeper-model baseline: ``config.deeper_num_layers`` extra post-LN transformer layers on ``z_L``.

    Assumed form (the paper does not publish it): standard encoder layers (``nn.TransformerEncoderLayer``,
    GELU, the backbone's dropout) whose FFN width ``config.deeper_intermediate_size`` is solved from the
    DWAtt head's parameter count. Unlike the fusion heads it attends across tokens, honouring padding.
    """

    def __init__(self, config: DWAttConfig):
        super().__init__()
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

    def forward(self, last: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """last: z_L [B, T, D]; attention_mask: [B, T] with 1 = real token. Returns [B, T, D]."""
        padding = None if attention_mask is None else attention_mask == 0  # (B, T), True = ignore
        hidden = last
        for layer in self.layers:
            hidden = layer(hidden, src_key_padding_mask=padding)
        return hidden


__all__ = ["DWAttConcatFusion", "DWAttDeeperFusion", "DWAttDepthAttention", "DWAttMLP"]
