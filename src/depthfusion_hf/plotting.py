"""Figures: the learned DWA weight matrix (as in the DenseFormer paper's Figure 5), the main job's per-family
analysis plots (named in the family registry) and the few-shot NER F1 curves."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def agg_pyplot():
    """matplotlib's ``pyplot`` on the non-interactive Agg backend (imported on first use: matplotlib is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Lay out ``fig`` (unless it has a layout engine), write it to ``path`` (120 dpi; missing folders are created)
    and close it; returns ``path``."""
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    agg_pyplot().close(fig)
    return path


def draw_heatmap(fig, ax, matrix: torch.Tensor, annotate: bool, text_color, fontsize: int, **imshow):
    """Draw ``matrix`` [R, C] on ``ax`` with its exact zeros (unconnected entries) blank and a colour bar; with
    ``annotate`` each non-zero value is written in its cell, in the colour ``text_color(value)``. Returns the bar."""
    import numpy as np

    image = ax.imshow(matrix.masked_fill(matrix == 0, float("nan")).numpy(), **imshow)
    if annotate:
        for (i, j), value in np.ndenumerate(matrix.numpy()):
            if value != 0:
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=fontsize, color=text_color(value))
    return fig.colorbar(image, ax=ax, shrink=0.8)


def plot_dwa_heatmap(weights: torch.Tensor, path: str | Path, title: str = "DWA weights") -> Path:
    """Save a heatmap of a [d, d + 1] DWA weight matrix (row i: the weights of the DWA after block i + 1).

    Unconnected entries (exact zeros) are blank; the colour scale is symmetric around 0.
    """
    plt = agg_pyplot()
    matrix = weights.detach().float().cpu()
    if matrix.dim() != 2 or matrix.shape[1] != matrix.shape[0] + 1:
        raise ValueError(f"weights must have shape [d, d + 1]; got {tuple(matrix.shape)}")
    limit = max(float(matrix.abs().max()), 1e-6)
    side = max(5.0, 1.5 + 0.35 * matrix.shape[1])
    fig, ax = plt.subplots(figsize=(side + 1.0, max(4.0, 1.2 + 0.35 * matrix.shape[0])))
    # small matrices: print the weights, most of which are close to 0
    draw_heatmap(fig, ax, matrix, matrix.shape[0] <= 12, lambda v: "white" if abs(v) > 0.6 * limit else "black", 7,
                 cmap="RdBu_r", vmin=-limit, vmax=limit)
    ax.set_xlabel("source j (0 = embeddings, j = output of block j)")
    ax.set_ylabel("DWA after block i")
    ax.set_xticks(range(matrix.shape[1]))
    ax.set_yticks(range(matrix.shape[0]), labels=[str(i + 1) for i in range(matrix.shape[0])])
    ax.set_title(title, fontsize=10)
    return save_figure(fig, path)


# The main job's analysis plots (families.AnalysisPlot: trained model, output folder, one validation sequence [1, T],
# run label -> the file written), named in the family registry.


def plot_denseformer_analysis(model, out_dir: str | Path, sample_ids: torch.Tensor, label: str) -> Path:
    """DenseFormer: the learned DWA weights (they do not depend on ``sample_ids``), ``out_dir/dwa_weights.png``."""
    return plot_dwa_heatmap(model.dwa_weights(), Path(out_dir) / "dwa_weights.png",
                            title=f"learned DWA weights ({label})")


def plot_moda_analysis(model, out_dir: str | Path, sample_ids: torch.Tensor, label: str) -> Path:
    """MoDA: each layer's share of attention mass on depth entries over ``sample_ids``, a bar chart
    ``out_dir/moda_depth_share.png`` (the title names the family, not ``label``)."""
    share = model.depth_attention_share(sample_ids.to(model.device))
    fig, ax = agg_pyplot().subplots(figsize=(6, 3.5))
    ax.bar(range(len(share)), list(share))
    ax.set_xlabel("layer")
    ax.set_ylabel("attention mass on depth entries")
    ax.set_title("MoDA: share of attention on depth KVs per layer")
    return save_figure(fig, Path(out_dir) / "moda_depth_share.png")


def plot_f1_vs_size(rows: Sequence[dict], fusions: Sequence[str], path: str | Path, title: str) -> Path:
    """Few-shot NER: test F1 (mean ± std over seeds) against the mean number of training sentences, one line
    per fusion method. ``rows`` are the summary rows of ``recipes.ner.summarise``."""
    plt = agg_pyplot()

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for fusion in fusions:
        mine = sorted((r for r in rows if r["fusion"] == fusion), key=lambda r: r["train_sentences"])
        if mine:
            ax.errorbar([r["train_sentences"] for r in mine], [r["f1_mean"] for r in mine],
                        yerr=[r["f1_std"] for r in mine], marker="o", capsize=3, label=fusion)
    labelled = sorted({(r["train_sentences"], r["size"]) for r in rows})
    ax.set_xscale("log")
    ax.set_xticks([x for x, _ in labelled], [f"{label}\n({x:.0f})" for x, label in labelled])
    ax.minorticks_off()
    ax.set_xlabel("training size (mean training sentences)")
    ax.set_ylabel("test entity F1 (seqeval)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


__all__ = ["agg_pyplot", "draw_heatmap", "plot_denseformer_analysis", "plot_dwa_heatmap", "plot_f1_vs_size",
           "plot_moda_analysis", "save_figure"]
