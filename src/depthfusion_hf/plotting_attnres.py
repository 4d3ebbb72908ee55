"""Figures for AttnRes: the depth-attention weights (each call's softmax over its sources) as a heatmap.

It uses the figure helpers of :mod:`depthfusion_hf.plotting` (matplotlib is imported on first use).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .plotting import agg_pyplot, save_figure


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
    """Save a heatmap of an AttnRes depth-attention matrix (``model.depth_attention_weights(ids)``).

    Args:
        weights: [2L + 1, N_max]: row c = the softmax of the call feeding sub-layer c + 1 (last row: the final
            call), averaged over tokens; 0 where a call has no such source (left blank).
        path: the PNG to write (folders are created).
        num_layers: L, the model's ``num_hidden_layers``.
        block_size: the config's ``attnres_block_size`` (None = full AttnRes), for the labels.
        title: the figure title.
    Returns:
        ``path``.
    Raises:
        ValueError: if ``weights`` does not have the shape these settings give.
    """
    plt = agg_pyplot()
    import numpy as np

    rows, cols = depth_attention_labels(num_layers, block_size)
    matrix = weights.detach().float().cpu()
    if tuple(matrix.shape) != (len(rows), len(cols)):
        raise ValueError(f"weights must have shape [2L + 1, N + 1] = {(len(rows), len(cols))} for L = {num_layers}, "
                         f"attnres_block_size = {block_size}; got {tuple(matrix.shape)}")
    masked = matrix.masked_fill(matrix == 0, float("nan")).numpy()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 + 0.42 * len(cols)), max(4.0, 1.2 + 0.32 * len(rows))))
    image = ax.imshow(masked, cmap="viridis", vmin=0.0, vmax=max(float(matrix.max()), 1e-6), aspect="auto")
    if len(rows) * len(cols) <= 400:  # small matrices: print the weights
        for (i, j), value in np.ndenumerate(matrix.numpy()):
            if value != 0:
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6,
                        color="black" if value > 0.6 * float(matrix.max()) else "white")
    ax.set_xticks(range(len(cols)), labels=cols, fontsize=7)
    ax.set_yticks(range(len(rows)), labels=rows, fontsize=7)
    # Two lines: one would be wider than a narrow heatmap's figure.
    ax.set_xlabel("source (emb = embedding;\n" + ("v_i = output of sub-layer i)" if block_size is None
                                                   else f"b_n = sum of block n of {block_size} sub-layers, so far)"),
                  fontsize=9)
    ax.set_ylabel("AttnRes call feeding")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8, label="mean softmax weight")
    return save_figure(fig, path)


def plot_attnres_analysis(model, out_dir: str | Path, sample_ids: torch.Tensor, label: str) -> Path:
    """The main job's AttnRes figure: the depth-attention weights on a validation sequence,
    ``out_dir/attnres_depth_weights.png``.

    Args:
        model: a trained ``AttnResForCausalLM``.
        out_dir: the run's output folder.
        sample_ids: [1, T] token ids of one validation sequence; the weights are averaged over its tokens.
        label: the run, e.g. ``"attnres block 4, 500 steps"``, shown in the title.
    """
    config = model.config
    weights = model.depth_attention_weights(sample_ids.to(model.device))
    return plot_depth_attention_heatmap(weights, Path(out_dir) / "attnres_depth_weights.png",
                                        config.num_hidden_layers, config.attnres_block_size,
                                        title=f"AttnRes depth-attention weights ({label})")


__all__ = ["depth_attention_labels", "plot_attnres_analysis", "plot_depth_attention_heatmap"]
