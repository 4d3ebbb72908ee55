"""Parameter counts of the DWAtt fusion heads (plain integers, no torch) and the field checks they share.

The config sizes the ``concat`` and ``deeper`` baselines to the DWAtt head's budget with these functions.
"""

from __future__ import annotations


def dwatt_head_num_params(hidden_size: int, num_states: int, bottleneck_size: int, depth_embedding_size: int) -> int:
    """Parameters of ``DWAttDepthAttention`` for width D and ``num_states`` = L + 1.

    ``f(x) = W LN(GELU(U x))`` costs ``2 D b + 3 b + D`` with bottleneck ``b``; the head has one ``f`` per state
    plus one for the query, an output LayerNorm per state (``2 D``), the depth embeddings ``(L + 1) d_pos`` and
    ``W_K`` (``d_pos D + D``).
    """
    mlp = 2 * hidden_size * bottleneck_size + 3 * bottleneck_size + hidden_size
    values = num_states * (mlp + 2 * hidden_size)
    keys = num_states * depth_embedding_size + depth_embedding_size * hidden_size + hidden_size
    return values + mlp + keys


def concat_head_num_params(hidden_size: int, num_states: int, concat_hidden_size: int) -> int:
    """Parameters of the Concat head ``W_2 LN(GELU(W_1 [z_0; ...; z_L]))`` with inner width ``m``."""
    m = concat_hidden_size
    return num_states * hidden_size * m + m + 2 * m + m * hidden_size + hidden_size


def concat_params_per_unit(hidden_size: int, num_states: int) -> int:
    """Parameters one unit of Concat inner width costs, ``(L + 1) D + 3 + D`` (the rounding error bound x 2)."""
    return num_states * hidden_size + 3 + hidden_size


def deeper_head_num_params(hidden_size: int, intermediate_size: int, num_layers: int = 1) -> int:
    """Parameters of ``num_layers`` post-LN transformer layers (attention + FFN of width ``intermediate_size``)."""
    attention = 4 * hidden_size * hidden_size + 4 * hidden_size
    ffn = 2 * hidden_size * intermediate_size + intermediate_size + hidden_size
    return num_layers * (attention + ffn + 4 * hidden_size)  # + two LayerNorms


def deeper_params_per_unit(hidden_size: int, num_layers: int = 1) -> int:
    """Parameters one unit of FFN width costs the deeper baseline: ``layers (2 D + 1)``."""
    return num_layers * (2 * hidden_size + 1)


def solve_concat_hidden_size(hidden_size: int, num_states: int, budget: int) -> int:
    """The Concat inner width ``m >= 1`` whose head size is closest to ``budget`` parameters."""
    return max(1, round((budget - hidden_size) / concat_params_per_unit(hidden_size, num_states)))


def solve_deeper_intermediate_size(hidden_size: int, budget: int, num_layers: int = 1) -> int:
    """The FFN width ``>= 1`` of the deeper baseline whose size is closest to ``budget`` parameters (1, and a
    head over budget, when attention alone exceeds it)."""
    fixed = deeper_head_num_params(hidden_size, 0, num_layers)
    return max(1, round((budget - fixed) / deeper_params_per_unit(hidden_size, num_layers)))


def check_int(name: str, value, low: int = 1) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is an int (not a bool) ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an integer >= {low}; got {value!r}")


def check_fraction(name: str, value, allow_zero: bool) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a number in [0, 1) (``allow_zero``) or (0, 1]."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and (0.0 <= value < 1.0 if allow_zero else 0.0 < value <= 1.0)):
        raise ValueError(f"`{name}` must be a number in {'[0, 1)' if allow_zero else '(0, 1]'}; got {value!r}")
