"""mHC configuration: a Llama-style decoder whose residual is ``hc_mult`` streams mixed by manifold-constrained
Hyper-Connections (DeepSeek-V4; Xie et al., 2026)."""

from huggingface_hub.dataclasses import strict

from .configuration_decoder import DecoderConfigMixin
from .depthfusion_common import check_positive_int, check_real


@strict
class MHCConfig(DecoderConfigMixin):
    r"""Configuration of an mHC decoder: manifold-constrained Hyper-Connections (DeepSeek-V4; Xie et al., 2026).

    A Llama decoder (RMSNorm, RoPE, SwiGLU, GQA; every Llama field keeps its meaning) whose residual stream is
    ``hc_mult`` = n parallel streams per token (the embedding copied n times). Around every attention and MLP a
    hyper-connection reads the streams and gives per-token weights: ``pre`` collapses the streams into the
    sub-layer's input, ``post`` spreads its output back over the streams, and ``comb``, an n x n mixing of the
    streams, is projected towards the doubly-stochastic matrices by Sinkhorn-Knopp iterations. A final head
    collapses the streams before the last norm. The fields are transformers' ``DeepseekV4Config``'s.

    Args:
        hc_mult (`int`, defaults to 4): n, the number of residual streams. Allowed: ``n >= 1``; ``n = 1`` is a
            plain residual whose sub-layer outputs and inputs pass through learned per-token gates.
        hc_sinkhorn_iters (`int`, defaults to 20): Sinkhorn-Knopp iterations projecting ``comb`` (one column
            normalisation, then ``iters - 1`` times rows and columns). Allowed: ``>= 1``.
        hc_eps (`float`, defaults to 1e-6): added to ``pre`` and to ``comb`` after its softmax, and to every
            Sinkhorn denominator. Allowed: a finite number > 0.
        op_backend (`str` or None, defaults to None): which implementation of the family's ops runs:
            ``"reference"`` (the formulas' loops), ``"torch"`` (vectorised PyTorch), ``"triton"`` (the fused
            kernels, CUDA), or None / ``"auto"`` (Triton for CUDA tensors when it imports, else PyTorch). An
            op's ``backend=`` argument and ``$DEPTHFUSION_BACKEND`` take precedence over it.

    The streams are normalised by an unweighted RMSNorm with the Llama ``rms_norm_eps`` before the projection,
    as in transformers' ``DeepseekV4HyperConnection``. Every inherited Llama field is validated as for the other
    decoder families, and an unknown key that looks like a family option (``hc_mutl``) is an error naming the
    nearest valid field.

    Example:
        >>> config = MHCConfig(num_hidden_layers=12, hc_mult=4)
    """

    model_type = "mhc"
    option_prefix = "hc_"  # its options' names start so (a misspelt one is refused)

    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float | int = 1e-6
    op_backend: str | None = None

    def check_family_fields(self) -> None:
        """Validate every field; raise a ValueError naming the field and its allowed values.

        Runs at construction and again when a model is built from this config, so that a field changed after
        construction (e.g. ``config.hc_mult = 0``) gets the same error.
        """
        check_positive_int("hc_mult", self.hc_mult)
        check_positive_int("hc_sinkhorn_iters", self.hc_sinkhorn_iters)
        check_real("hc_eps", self.hc_eps, 0.0)


__all__ = ["MHCConfig"]
