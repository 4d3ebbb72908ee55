"""The statistics of a study: paired differences over seeds with Student-t intervals, and a loss curve read at a
given training time."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# Two-sided 95 % quantiles t_{0.975, df} of Student's t for df = 1..30.
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)


def t_quantile_975(df: int) -> float:
    """Student's t 0.975 quantile for ``df`` degrees of freedom (a table to 30, Cornish-Fisher beyond: error < 1e-4).

    Raises:
        ValueError: ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1; got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``nan`` for one value)."""
    values = list(values)
    if not values:
        raise ValueError("mean_std needs at least one value")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")


@dataclass(frozen=True)
class PairedSummary:
    """Paired differences ``model - baseline`` over seeds (negative: the model's loss is lower).

    Attributes:
        n: number of pairs; mean, std: of the differences; low, high: the 95 % t-interval of the mean
        (``nan`` for one pair); won: pairs with a negative difference (the model wins the seed).
    """

    n: int
    mean: float
    std: float
    low: float
    high: float
    won: int


def paired_summary(differences: Sequence[float], higher_is_better: bool = False) -> PairedSummary:
    """Mean, std, 95 % t-interval and seeds won of paired differences.

    A seed is won when its difference is negative (a loss), or positive with ``higher_is_better`` (a score
    such as F1); a tie is not a win.
    """
    mean, std = mean_std(differences)
    n = len(differences)
    half = t_quantile_975(n - 1) * std / math.sqrt(n) if n > 1 else float("nan")
    won = sum((d > 0) if higher_is_better else (d < 0) for d in differences)
    return PairedSummary(n, mean, std, mean - half, mean + half, won)


def interpolate_curve(curve: Sequence[dict], x: float, key: str = "seconds") -> tuple[float, bool]:
    """The eval loss of a curve at ``x`` (``seconds`` or ``step``), linear between evaluations.

    Returns:
        ``(loss, reached)``: ``reached`` is False when ``x`` lies beyond the curve's last point; the loss is then
        the last one (the run ended before the budget: a lower bound on what it would have reached is unknown,
        so this is what it had, not an extrapolation).
    Raises:
        ValueError: an empty curve, or ``x`` before the first point.
    """
    points = sorted((p[key], p["eval_loss"]) for p in curve)
    if not points:
        raise ValueError("the curve is empty")
    if x < points[0][0]:
        raise ValueError(f"{key}={x} lies before the curve's first point ({points[0][0]})")
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return (y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)), True
    return points[-1][1], x <= points[-1][0]


__all__ = ["PairedSummary", "interpolate_curve", "mean_std", "paired_summary", "t_quantile_975"]
