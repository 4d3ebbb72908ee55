"""Parameter and forward-FLOP counts of a MoDA config and of its plain (Llama/OLMo2-style) baseline.

Conventions (chosen to match the paper's Table 3, see docs/MODA.md):

- FLOPs are forward FLOPs, 2 per multiply-add, reported per token and per sequence of
  ``seq_len`` tokens. Matmuls: every linear layer including the LM head; the embedding lookup is free.
- Sequence attention: ``4 * Hq * d`` per (query, key) pair (``q.k`` and ``p.v``), over
  ``seq_len`` keys per query when ``causal=False`` (the paper's convention: the 38-layer baseline
  of Table 3 adds exactly two layers' worth of full T x T attention) or the causal average
  ``(seq_len + 1) / 2`` when ``causal=True``.
- Depth attention: ``4 * Hq * d`` per depth entry; layer ``l`` reads ``l`` entries (``2 l`` with
  the FFN-side K/V), or ``min(l, W)`` (``2 min(l, W)``) with ``moda_depth_window = W``.
- ``nonmatmul=True`` adds an estimate of the element-wise work: 5 FLOPs per softmax score
  (max, subtract, exp, sum, divide), 4 per RMSNorm element, 4 per SwiGLU intermediate element,
  1 per residual add, 5 per vocabulary logit for the final softmax.

This file only needs ``transformers``' config fields; it is self-contained like the rest of the folder.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelCost:
    """Counts for one model. Parameters are absolute; FLOPs are forward FLOPs."""

    params: int
    params_embedding: int
    params_lm_head: int
    params_ffn_kv: int
    flops_per_token: float
    flops_per_sequence: float
    depth_entries_per_token: int

    def as_dict(self) -> dict:
        """The fields as a plain dict (for JSON / tables)."""
        return asdict(self)


def _field(config, name: str, default=None):
    value = getattr(config, name, default) if not isinstance(config, dict) else config.get(name, default)
    return default if value is None else value


def moda_cost(
    config,
    seq_len: int,
    moda: bool = True,
    causal: bool = False,
    nonmatmul: bool = False,
) -> ModelCost:
    """Parameters and forward FLOPs of a MoDA config (``moda=True``) or its plain baseline (``moda=False``).

    Args:
        config: a ``MoDAConfig`` / ``LlamaConfig`` or a dict with the same fields.
        seq_len: T, the training sequence length used for the attention terms.
        moda: count the MoDA additions (FFN-side K/V projections when ``moda_ffn_kv``, depth attention).
        causal: count only the causal half of the sequence attention (see the module docstring).
        nonmatmul: add the element-wise estimate (softmax, norms, SwiGLU, residuals).
    Returns:
        A :class:`ModelCost`.
    Raises:
        ValueError: if ``seq_len`` is not a positive integer.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"`seq_len` must be an integer >= 1; got {seq_len!r}")
    vocab = _field(config, "vocab_size")
    width = _field(config, "hidden_size")
    inter = _field(config, "intermediate_size")
    layers = _field(config, "num_hidden_layers")
    q_heads = _field(config, "num_attention_heads")
    kv_heads = _field(config, "num_key_value_heads", q_heads)
    head_dim = _field(config, "head_dim", width // q_heads)
    tied = bool(_field(config, "tie_word_embeddings", False))
    attn_bias = bool(_field(config, "attention_bias", False))
    mlp_bias = bool(_field(config, "mlp_bias", False))
    ffn_kv = moda and bool(_field(config, "moda_ffn_kv", True))

    q_dim, kv_dim = q_heads * head_dim, kv_heads * head_dim
    attn = width * (q_dim + 2 * kv_dim) + q_dim * width + (2 * q_dim + 2 * kv_dim + width if attn_bias else 0)
    mlp = 3 * width * inter + (2 * inter + width if mlp_bias else 0)
    norms = 2 * width
    ffn_kv_layer = width * 2 * kv_dim + (2 * kv_dim if attn_bias else 0)
    ffn_kv_layers = layers - 1 if ffn_kv else 0  # the last layer's entry would never be read
    embedding = vocab * width
    lm_head = 0 if tied else vocab * width
    params_ffn_kv = ffn_kv_layers * ffn_kv_layer
    params = embedding + lm_head + layers * (attn + mlp + norms) + width + params_ffn_kv

    context = (seq_len + 1) / 2 if causal else seq_len
    window = _field(config, "moda_depth_window")  # None: every earlier layer
    read_layers = [i if window is None else min(i, window) for i in range(layers)]
    per_layer_depth = [(2 * n if ffn_kv else n) if moda else 0 for n in read_layers]
    depth_entries = sum(per_layer_depth)
    matmul_params = layers * (width * (q_dim + 2 * kv_dim) + q_dim * width + 3 * width * inter)
    matmul_params += ffn_kv_layers * width * 2 * kv_dim + vocab * width
    flops = 2.0 * matmul_params
    flops += 4.0 * q_heads * head_dim * (layers * context + depth_entries)
    if nonmatmul:
        flops += 5.0 * q_heads * (layers * context + depth_entries)  # softmax
        flops += 4.0 * width * (2 * layers + 1) + 4.0 * inter * layers + 2.0 * width * layers + 5.0 * vocab
    return ModelCost(
        params=params,
        params_embedding=embedding,
        params_lm_head=lm_head,
        params_ffn_kv=params_ffn_kv,
        flops_per_token=flops,
        flops_per_sequence=flops * seq_len,
        depth_entries_per_token=depth_entries,
    )


def compare_with_baseline(config, seq_len: int, causal: bool = False, nonmatmul: bool = False) -> dict:
    """MoDA vs its plain baseline: ``{"baseline": ModelCost, "moda": ModelCost, "params_ratio", "flops_ratio"}``."""
    base = moda_cost(config, seq_len, moda=False, causal=causal, nonmatmul=nonmatmul)
    ours = moda_cost(config, seq_len, moda=True, causal=causal, nonmatmul=nonmatmul)
    return {
        "baseline": base,
        "moda": ours,
        "params_ratio": ours.params / base.params,
        "flops_ratio": ours.flops_per_token / base.flops_per_token,
    }


__all__ = ["ModelCost", "compare_with_baseline", "moda_cost"]
