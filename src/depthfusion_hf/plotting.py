"""Figures: the learned DWA weight matrix (as in the DenseFormer paper's Figure 5) and per-layer curves."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def plot_dwa_heatmap(weights: torch.Tensor, path: str | Path, title: str = "DWA weights") -> Path:
    """Save a heatmap of a [d, d + 1] DWA weight matrix (row i: the weights of the DWA after block i + 1).

    Unconnected entries (exact zeros) are blank; the colour scale is symmetric around 0.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    matrix = weights.detach().float().cpu()
    if matrix.dim() != 2 or matrix.shape[1] != matrix.shape[0] + 1:
        raise ValueError(f"weights must have shape [d, d + 1]; got {tuple(matrix.shape)}")
    masked = matrix.masked_fill(matrix == 0, float("nan")).numpy()
    limit = max(float(matrix.abs().max()), 1e-6)
    side = max(5.0, 1.5 + 0.35 * matrix.shape[1])
    fig, ax = plt.subplots(figsize=(side + 1.0, max(4.0, 1.2 + 0.35 * matrix.shape[0])))
    image = ax.imshow(masked, cmap="RdBu_r", vmin=-limit, vmax=limit)
    if matrix.shape[0] <= 12:  # small matrices: print the weights, most of which are close to 0
        for (i, j), value in np.ndenumerate(matrix.numpy()):
            if value != 0:
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if abs(value) > 0.6 * limit else "black")
    ax.set_xlabel("source j (0 = embeddings, j = output of block j)")
    ax.set_ylabel("DWA after block i")
    ax.set_xticks(range(matrix.shape[1]))
    ax.set_yticks(range(matrix.shape[0]), labels=[str(i + 1) for i in range(matrix.shape[0])])
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_per_layer(values: Sequence[float], path: str | Path, ylabel: str, title: str) -> Path:
    """Save a bar chart of one value per layer (e.g. MoDA's share of attention mass on depth entries)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(len(values)), list(values))
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["plot_dwa_heatmap", "plot_per_layer"]
