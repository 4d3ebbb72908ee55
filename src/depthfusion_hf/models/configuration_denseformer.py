"""DenseFormer configuration: a Llama-style decoder plus the k×p Depth-Weighted Average knobs."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from .configuration_decoder import DecoderConfigMixin
from .depthfusion_common import check_positive_int


@strict
class DenseFormerConfig(DecoderConfigMixin):
    r"""Configuration of a DenseFormer (Pagliardini et al., 2024, arXiv 2402.02622).

    A Llama decoder (every Llama field keeps its meaning) with a Depth-Weighted Average after every
    ``dwa_period``-th block; the DWA after block ``i`` mixes the block outputs ``X_j`` with ``j <= i`` and
    ``j ≡ i (mod dwa_dilation)`` (``X_0`` = embeddings). Every field is validated, the Llama ones too, and an
    unknown key that looks like a family option (``dwa_dilaton``, ``moda_ffn_kv``) is an error naming the nearest.

    Args:
        dwa_dilation (`int`, defaults to 1): k, the dilation; 1 connects every earlier block.
            Allowed: ``1 <= k <= num_hidden_layers``.
        dwa_period (`int`, defaults to 1): p, a DWA step after block ``i`` only when ``p | i``.
            Allowed: ``1 <= p <= num_hidden_layers``.
        op_backend (`str` or None, defaults to None): which implementation of the family's op runs:
            ``"reference"``, ``"torch"``, ``"triton"``, or None / ``"auto"`` (Triton for CUDA tensors when it
            imports, else PyTorch). The op's ``backend=`` argument and ``$DEPTHFUSION_BACKEND`` take precedence.

    Example:
        >>> config = DenseFormerConfig(num_hidden_layers=12, dwa_dilation=4, dwa_period=5)
    """

    model_type = "denseformer"
    option_prefix = "dwa_"  # its options' names start so (a misspelt one is refused)

    dwa_dilation: int = 1
    dwa_period: int = 1
    op_backend: str | None = None

    def check_family_fields(self) -> None:
        """Raise a ValueError naming an invalid field and its allowed values; also run when a model is built
        (a field changed after construction, e.g. ``config.dwa_dilation = 0``, gets the same error)."""
        layers = self.num_hidden_layers
        check_positive_int("dwa_dilation", self.dwa_dilation, layers, "at most num_hidden_layers")
        check_positive_int("dwa_period", self.dwa_period, layers, "at most num_hidden_layers")


__all__ = ["DenseFormerConfig"]
