"""Parameter counts of the DWAtt fusion heads and the field checks they share: plain integers, no torch.

The config sizes the ``concat`` and ``deeper`` baselines to the DWAtt head's budget with these
functions when it is built, and stores the chosen widths in ``config.json``.
"""

from __future__ import annotations


def dwatt_head_num_params(hidden_size: int, num_states: int, bottleneck_size: int, depth_embedding_size: int) -> int:
    """Parameters of the DWAtt head (``DWAttDepthAttention``) for width D and ``num_states`` = L + 1.

    ``f(x) = W LN(GELU(U x))`` costs ``2 D b + 3 b + D`` with bottleneck ``b``; the head has one ``f``
    per state (values) plus one for the query, an output LayerNorm per state (``2 D`` each), the
    depth embeddings ``(L + 1) x d_pos`` and the key projection ``W_K`` (``d_pos D + D``).
    """
    mlp = 2 * hidden_size * bottleneck_size + 3 * bottleneck_size + hidden_size
    values = num_states * (mlp + 2 * hidden_size)
    keys = num_states * depth_embedding_size + depth_embedding_size * hidden_size + hidden_size
    return values + mlp + keys


def concat_head_num_params(hidden_size: int, num_states: int, concat_hidden_size: int) -> int:
    """Parameters of the Concat head: ``W_2 LN(GELU(W_1 [z_0; ...; z_L]))`` with inner width ``m``."""
    m = concat_hidden_size
    return num_states * hidden_size * m + m + 2 * m + m * hidden_size + hidden_size


def concat_params_per_unit(hidden_size: int, num_states: int) -> int:
    """Parameters one more unit of Concat inner width costs: ``(L + 1) D + 3 + D``.

    Rounding the width to the nearest integer leaves the Concat head within half of this of the budget.
    """
    return num_states * hidden_size + 3 + hidden_size


def deeper_head_num_params(hidden_size: int, intermediate_size: int, num_layers: int = 1) -> int:
    """Parameters of ``num_layers`` post-LN transformer layers (attention + FFN of width ``intermediate_size``)."""
    attention = 4 * hidden_size * hidden_size + 4 * hidden_size
    ffn = 2 * hidden_size * intermediate_size + intermediate_size + hidden_size
    norms = 4 * hidden_size
    return num_layers * (attention + ffn + norms)


def deeper_params_per_unit(hidden_size: int, num_layers: int = 1) -> int:
    """Parameters one more unit of FFN width costs the deeper baseline: ``layers (2 D + 1)``."""
    return num_layers * (2 * hidden_size + 1)


def solve_concat_hidden_size(hidden_size: int, num_states: int, budget: int) -> int:
    """The Concat inner width ``m >= 1`` whose head size is closest to ``budget`` parameters."""
    return max(1, round((budget - hidden_size) / concat_params_per_unit(hidden_size, num_states)))


def solve_deeper_intermediate_size(hidden_size: int, budget: int, num_layers: int = 1) -> int:
    """The FFN width ``>= 1`` of the deeper baseline whose size is closest to ``budget`` parameters.

    When even a width-1 FFN exceeds the budget (attention alone is too big) this returns 1; the
    head is then larger than the budget (``deeper_head_num_params`` tells by how much).
    """
    fixed = deeper_head_num_params(hidden_size, 0, num_layers)
    return max(1, round((budget - fixed) / deeper_params_per_unit(hidden_size, num_layers)))


def check_int(name: str, value, low: int = 1) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is an int (not a bool) ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an integer >= {low}; got {value!r}")


def check_fraction(name: str, value, allow_zero: bool) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a number in [0, 1) (``allow_zero``) or (0, 1]."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (0.0 <= value < 1.0 if allow_zero else 0.0 < value <= 1.0)
    if not ok:
        interval = "[0, 1)" if allow_zero else "(0, 1]"
        raise ValueError(f"`{name}` must be a number in {interval}; got {value!r}")


__all__ = [
    "check_fraction",
    "check_int",
    "concat_head_num_params",
    "concat_params_per_unit",
    "deeper_head_num_params",
    "deeper_params_per_unit",
    "dwatt_head_num_params",
    "solve_concat_hidden_size",
    "solve_deeper_intermediate_size",
]
