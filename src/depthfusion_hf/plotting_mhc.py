"""Figures for mHC: the learned hyper-connection weights of every sub-layer (``pre``, ``post`` and the ``comb``
mixing matrices), averaged over a sequence's tokens.

It uses the figure helpers of :mod:`depthfusion_hf.plotting` (matplotlib is imported on first use).
"""

from pathlib import Path

import torch

from .plotting import agg_pyplot, save_figure


def check_mhc_weights(weights: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(L, n)`` of the weights ``MHCForCausalLM.hyper_connection_weights`` returns.

    Raises:
        ValueError: unless ``pre`` and ``post`` are [L, 2, n], ``comb`` [L, 2, n, n] and ``head`` [n].
    """
    missing = {"pre", "post", "comb", "head"} - set(weights)
    if missing:
        raise ValueError(f"weights must hold 'pre', 'post', 'comb' and 'head'; missing {sorted(missing)}")
    layers, _, n = weights["pre"].shape if weights["pre"].dim() == 3 else (0, 0, 0)
    expected = {"pre": (layers, 2, n), "post": (layers, 2, n), "comb": (layers, 2, n, n), "head": (n,)}
    for key, shape in expected.items():
        if layers < 1 or n < 1 or tuple(weights[key].shape) != shape:
            raise ValueError(f"weights[{key!r}] must have shape {shape} ([L, 2, n] pre and post, [L, 2, n, n] comb, "
                             f"[n] head); got {tuple(weights[key].shape)}")
    return layers, n


def plot_mhc_weights(weights: dict[str, torch.Tensor], path: str | Path,
                     title: str = "mHC hyper-connection weights") -> Path:
    """Save a figure of the hyper-connection weights of every sub-layer to ``path``.

    Top: ``pre`` (how the sub-layer's input collapses the n streams; the last row is the head's) and ``post`` (how
    its output spreads over them), one row per sub-layer. Below: the ``comb`` matrix of every sub-layer (row j,
    column k: the weight of stream j in the new stream k), attention and MLP sub-layers of each layer.

    Args:
        weights: ``MHCForCausalLM.hyper_connection_weights(ids)``: pre / post [L, 2, n], comb [L, 2, n, n],
            head [n] (sub-layer 0 of a layer is its attention, 1 its MLP).
    Raises:
        ValueError: for weights of other shapes (:func:`check_mhc_weights`).
    """
    layers, n = check_mhc_weights(weights)
    plt = agg_pyplot()
    pre = torch.cat([weights["pre"].reshape(2 * layers, n), weights["head"].reshape(1, n)]).float().cpu()
    post = weights["post"].reshape(2 * layers, n).float().cpu()
    comb = weights["comb"].float().cpu()
    rows = [f"{layer} {kind}" for layer in range(1, layers + 1) for kind in ("attn", "mlp")]
    columns = min(layers, 12)  # comb panels per row of the figure
    comb_rows = 2 * -(-layers // columns)
    fig = plt.figure(figsize=(max(8.0, 1.2 * columns + 2.0), 0.28 * (2 * layers + 1) + 1.3 * comb_rows + 2.0),
                     layout="constrained")
    grid = fig.add_gridspec(1 + comb_rows, columns, height_ratios=[0.22 * (2 * layers + 1) + 0.6] + [1.0] * comb_rows)
    half = max(1, columns // 2)
    for position, (matrix, name, labels) in enumerate(((pre, "pre (input collapse)", rows + ["head"]),
                                                       (post, "post (output spread)", rows))):
        ax = fig.add_subplot(grid[0, position * half:half if position == 0 else columns])
        image = ax.imshow(matrix.numpy(), cmap="viridis", aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(n), labels=[f"s{k}" for k in range(n)], fontsize=7)
        ax.set_yticks(range(len(labels)), labels=labels, fontsize=6)
        fig.colorbar(image, ax=ax, shrink=0.8)
    limit = max(float(comb.max()), 1e-6)
    comb_axes = []
    for layer in range(layers):
        for sub, kind in enumerate(("attn", "mlp")):
            ax = fig.add_subplot(grid[1 + 2 * (layer // columns) + sub, layer % columns])
            comb_axes.append(ax)
            image = ax.imshow(comb[layer, sub].numpy(), cmap="magma", vmin=0.0, vmax=limit)
            ax.set_title(f"{layer + 1} {kind}", fontsize=7)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.colorbar(image, ax=comb_axes, shrink=0.8, label="comb[j, k]:\nstream j -> new stream k")
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def plot_mhc_analysis(model, out_dir: str | Path, sample_ids: torch.Tensor, label: str) -> Path:
    """mHC's analysis plot (a ``families.AnalysisPlot``): the hyper-connection weights averaged over the tokens of
    ``sample_ids`` [1, T], ``out_dir/mhc_weights.png``."""
    weights = model.hyper_connection_weights(sample_ids.to(model.device))
    return plot_mhc_weights(weights, Path(out_dir) / "mhc_weights.png",
                            title=f"mHC hyper-connection weights ({label})")


__all__ = ["check_mhc_weights", "plot_mhc_analysis", "plot_mhc_weights"]
