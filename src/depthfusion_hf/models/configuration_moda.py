"""MoDA configuration: a Llama-style decoder (or a Mistral, Qwen2 or Qwen3 backbone) plus the mixture-of-depths
attention knobs."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

from .configuration_decoder import DecoderConfigMixin
from .depthfusion_common import check_positive_int, check_real

NORM_POSITIONS = ("pre", "post")


@strict
class MoDAConfig(DecoderConfigMixin):
    r"""Configuration of a MoDA decoder (Zhu et al., 2026, arXiv 2603.15619).

    A Llama decoder (RMSNorm, RoPE, SwiGLU, GQA; every Llama field keeps its meaning), or with ``backbone_config``
    a Mistral, Qwen2 or Qwen3 one (:attr:`supported_backbones`), whose attention also reads, in the same softmax,
    the depth stream of the query's own token: the attention K/V of every earlier layer and, with ``moda_ffn_kv``,
    one FFN-side K/V pair per earlier layer.

    Args:
        moda_ffn_kv (`bool`, defaults to True): add the paper's "Extra FFN KV Proj.": each layer
            except the last (whose entry no layer reads) projects its FFN input ``D -> 2 * Hkv * d``
            to one more depth K/V pair. Layer ``l`` then reads ``2 l`` depth entries (``l`` without).
        norm_position (`str`, defaults to ``"pre"``): ``"pre"`` is Llama's pre-norm block;
            ``"post"`` is the classic post-norm block ``h = norm(x + attn(x)); y = norm(h + mlp(h))``,
            which the paper finds gains more from MoDA. Allowed: ``"pre"``, ``"post"``.
        moda_depth_window (`int` or None, defaults to None): W, keep only the depth entries written by
            the last ``W`` layers (layer ``l`` reads those of layers ``max(0, l - W) .. l - 1``), so the
            depth cost grows as ``L W`` instead of ``L^2`` (the paper's §6.2 direction). None reads every
            earlier layer (the paper's MoDA). Allowed: None or ``1 <= W <= num_hidden_layers``.
        moda_depth_gate (`bool`, defaults to False): give every layer that reads depth entries a learned
            per-query-head gate ``g >= 0`` multiplying its depth scores in the joint softmax: ``o = (Z_s o_s +
            g Z_d o_d) / (Z_s + g Z_d)`` (``g = max(depth_gate, 0) * exp(depth_gate_log_scale)``, the log-scale a
            buffer that ``llama_to_moda`` can calibrate, else 0). Not in the paper; ``g = 0`` is Llama's attention
            exactly, which is how ``llama_to_moda`` keeps a converted model equal to its source (docs/MODA.md).
            False is the paper's MoDA.
        moda_depth_gate_init (`float`, defaults to 1.0): the gates' initial value (a finite number >= 0; 1 = the
            paper's softmax, 0 = closed). Used when the gates are initialised, not when they are loaded.
        op_backend (`str` or None, defaults to None): which implementation of the family's op runs:
            ``"reference"`` (the paper's loop), ``"torch"`` (vectorised PyTorch), ``"triton"`` (the fused
            kernel, CUDA), or None / ``"auto"`` (Triton for CUDA tensors when it imports, else PyTorch). An
            op's ``backend=`` argument and ``$DEPTHFUSION_BACKEND`` take precedence over it.

    Example:
        >>> config = MoDAConfig(num_hidden_layers=36, hidden_size=1024, norm_position="post")
    """

    # the backbones whose attention it extends (docs/MODA.md, "Backbones"); Gemma 3, Phi-3 and OLMo 2 are refused
    supported_backbones = ("llama", "mistral", "qwen2", "qwen3")
    model_type = "moda"
    option_prefix = "moda_"  # its options' names start so (a misspelt one is refused)

    moda_ffn_kv: bool = True
    norm_position: str = "pre"
    moda_depth_window: int | None = None
    moda_depth_gate: bool = False
    moda_depth_gate_init: float = 1.0
    op_backend: str | None = None

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The backbone's plan (Llama's by default), plus the FFN-side depth K/V projection where the layers have one
        (``moda_ffn_kv``): it is laid out head-major ([Hkv, 2, d]), so a column-wise shard holds whole heads, like
        k_proj / v_proj; its k-norm (Qwen3) is planned as the attention's."""
        backbone = vars(self).get("backbone_config")
        backbone_class = LlamaConfig if backbone is None or isinstance(backbone, dict) else type(backbone)
        plan = dict(backbone_class.base_model_tp_plan)
        if self.moda_ffn_kv:
            plan["layers.*.ffn_kv_proj"] = "colwise"
            if "layers.*.self_attn.k_norm" in plan:
                plan["layers.*.ffn_k_norm"] = plan["layers.*.self_attn.k_norm"]
        return {**plan, **vars(self).get("base_model_tp_plan", {})}

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan: dict[str, str]) -> None:
        # transformers < 5.21 adds `embed_tokens` to the plan of a config with tied embeddings: kept as an entry beside
        # the computed plan (not serialised: transformers drops `base_model_tp_plan` from config.json).
        computed = {**LlamaConfig.base_model_tp_plan, "layers.*.ffn_kv_proj": "colwise"}
        vars(self)["base_model_tp_plan"] = {key: value for key, value in plan.items() if key not in computed}

    def check_family_fields(self) -> None:
        """Validate every field; raise a ValueError naming the field and its allowed values.

        Runs at construction and again when a model is built from this config, so that a field
        changed after construction (e.g. ``config.moda_depth_window = 0``) gets the same error.
        """
        if not isinstance(self.moda_ffn_kv, bool):
            raise ValueError(f"`moda_ffn_kv` must be a bool (True or False); got {self.moda_ffn_kv!r}")
        if not isinstance(self.moda_depth_gate, bool):
            raise ValueError(f"`moda_depth_gate` must be a bool (True or False); got {self.moda_depth_gate!r}")
        check_real("moda_depth_gate_init", self.moda_depth_gate_init, 0.0, closed_lower=True)
        if self.norm_position not in NORM_POSITIONS:
            raise ValueError(f"`norm_position` must be one of {NORM_POSITIONS}; got {self.norm_position!r}")
        if self.attention_dropout:
            raise ValueError(
                f"`attention_dropout` must be 0.0 (the MoDA op has no dropout); got {self.attention_dropout!r}"
            )
        if self.moda_depth_window is not None:
            check_positive_int("moda_depth_window", self.moda_depth_window, self.num_hidden_layers,
                               "at most num_hidden_layers, or None for all earlier layers")


__all__ = ["MoDAConfig"]
