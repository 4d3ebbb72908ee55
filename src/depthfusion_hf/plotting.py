"""Figures: the learned DWA weight matrix (as in the DenseFormer paper's Figure 5), per-layer bars, the main
job's per-family analysis plots (named in the family registry) and the few-shot NER F1 curves."""

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


def plot_dwa_heatmap(weights: torch.Tensor, path: str | Path, title: str = "DWA weights") -> Path:
    """Save a heatmap of a [d, d + 1] DWA weight matrix (row i: the weights of the DWA after block i + 1).

    Unconnected entries (exact zeros) are blank; the colour scale is symmetric around 0.
    """
    plt = agg_pyplot()
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
    return save_figure(fig, path)


def plot_per_layer(values: Sequence[float], path: str | Path, ylabel: str, title: str) -> Path:
    """Save a bar chart of one value per layer (e.g. MoDA's share of attention mass on depth entries)."""
    plt = agg_pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(len(values)), list(values))
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return save_figure(fig, path)


def plot_denseformer_analysis(model, out_dir: str | Path, sample_ids: torch.Tensor, label: str) -> Path:
    """The main job's DenseFormer figure: the learned DWA weights as ``out_dir/dwa_weights.png``.

    Args:
        model: a trained ``DenseFormerForCausalLM``.
        out_dir: the run's output folder.
        sample_ids: [1, T] token ids (unused: the weights do not depend on the input).
        label: the run, e.g. ``"denseformer 2x2, 500 steps"``, shown in the title.
    """
    return plot_dwa_heatmap(model.dwa_weights(), Path(out_dir) / "dwa_weights.png",
                            title=f"learned DWA weights ({label})")


def plot_moda_analysis(model, out_dir: str | Path, sample_ids: torch.Tensor, label: str) -> Path:
    """The main job's MoDA figure: each layer's attention mass on depth entries, ``out_dir/moda_depth_share.png``.

    Args:
        model: a trained ``MoDAForCausalLM``.
        out_dir: the run's output folder.
        sample_ids: [1, T] token ids of one validation sequence, on which the share is measured.
        label: the run (unused; the title names the family).
    """
    share = model.depth_attention_share(sample_ids.to(model.device))
    return plot_per_layer(share, Path(out_dir) / "moda_depth_share.png", "attention mass on depth entries",
                          "MoDA: share of attention on depth KVs per layer")


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


__all__ = [
    "agg_pyplot",
    "plot_denseformer_analysis",
    "plot_dwa_heatmap",
    "plot_f1_vs_size",
    "plot_moda_analysis",
    "plot_per_layer",
    "save_figure",
]
