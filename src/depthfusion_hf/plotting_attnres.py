"""Figures for AttnRes: the depth-attention weights (each call's softmax over its sources) as a heatmap.

It uses the figure helpers of :mod:`depthfusion_hf.plotting` (matplotlib is imported on first use).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .plotting import agg_pyplot, draw_heatmap, save_figure


def depth_attention_labels(num_layers: int, block_size: int | None) -> tuple[list[str], list[str]]:
    """Row and column labels of an AttnRes depth-attention matrix [2L + 1, N_max].

    Rows: the call feeding each sub-layer (``"1 attn"``, ``"1 mlp"``, .., layers 1-based) and ``"final"``.
    Columns: ``"emb"`` then ``"v1"``.. (full AttnRes: sub-layer outputs) or ``"b1"``.. (block sums).
    """
    rows = [f"{layer} {kind}" for layer in range(1, num_layers + 1) for kind in ("attn", "mlp")] + ["final"]
    sources = 2 * num_layers if block_size is None else -(-2 * num_layers // block_size)
    prefix = "v" if block_size is None else "b"
    return rows, ["emb"] + [f"{prefix}{i}" for i in range(1, sources + 1)]


def plot_depth_attention_heatmap(
    weights: torch.Tensor,
    path: str | Path,
    num_layers: int,
    block_size: int | None,
    title: str = "AttnRes depth-attention weights",
) -> Path:
    """Save a heatmap of an AttnRes depth-attention matrix (``model.depth_attention_weights(ids)``) to ``path``.

    Args:
        weights: [2L + 1, N_max]: row c = the softmax of the call feeding sub-layer c + 1 (last row: the final
            call), averaged over tokens; 0 where a call has no such source (left blank).
        num_layers: L, the model's ``num_hidden_layers``.
        block_size: the config's ``attnres_block_size`` (None = full AttnRes), for the labels.
    Raises:
        ValueError: if ``weights`` does not have the shape these settings give.
    """
    plt = agg_pyplot()
    rows, cols = depth_attention_labels(num_layers, block_size)
    matrix = weights.detach().float().cpu()
    if tuple(matrix.shape) != (len(rows), len(cols)):
        raise ValueError(f"weights must have shape [2L + 1, N + 1] = {(len(rows), len(cols))} for L = {num_layers}, "
                         f"attnres_block_size = {block_size}; got {tuple(matrix.shape)}")
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 + 0.42 * len(cols)), max(4.0, 1.2 + 0.32 * len(rows))))
    top = float(matrix.max())
    bar = draw_heatmap(fig, ax, matrix, len(rows) * len(cols) <= 400, lambda v: "black" if v > 0.6 * top else "white",
                       6, cmap="viridis", vmin=0.0, vmax=max(top, 1e-6), aspect="auto")  # small matrices: printed
    bar.set_label("mean softmax weight")
    ax.set_xticks(range(len(cols)), labels=cols, fontsize=7)
    ax.set_yticks(range(len(rows)), labels=rows, fontsize=7)
    # Two lines: one would be wider than a narrow heatmap's figure.
    ax.set_xlabel("source (emb = embedding;\n" + ("v_i = output of sub-layer i)" if block_size is None
                                                   else f"b_n = sum of block n of {block_size} sub-layers, so far)"),
                  fontsize=9)
    ax.set_ylabel("AttnRes call feeding")
    ax.set_title(title, fontsize=10)
    return save_figure(fig, path)


def plot_attnres_analysis(model, out_dir: str | Path, sample_ids: torch.Tensor, label: str) -> Path:
    """AttnRes's analysis plot (a ``families.AnalysisPlot``): the depth-attention weights averaged over the tokens of
    ``sample_ids`` [1, T], ``out_dir/attnres_depth_weights.png``."""
    config = model.config
    weights = model.depth_attention_weights(sample_ids.to(model.device))
    return plot_depth_attention_heatmap(weights, Path(out_dir) / "attnres_depth_weights.png",
                                        config.num_hidden_layers, config.attnres_block_size,
                                        title=f"AttnRes depth-attention weights ({label})")


__all__ = ["depth_attention_labels", "plot_attnres_analysis", "plot_depth_attention_heatmap"]
