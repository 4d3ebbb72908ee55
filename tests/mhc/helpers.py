"""Inputs, tiny configs and transformers' own DeepSeek-V4 hyper-connection modules for the mHC tests."""

import contextlib

import torch
from transformers import LlamaConfig
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

from depthfusion_hf.models.configuration_mhc import MHCConfig
from depthfusion_hf.models.modeling_mhc import MHCForCausalLM
from tests.causal_lm_checks import TINY_DECODER

TINY = {**TINY_DECODER, "num_hidden_layers": 3}
EPS = {torch.float64: torch.finfo(torch.float64).eps, torch.float32: torch.finfo(torch.float32).eps,
       torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # unit roundoff of bf16 / fp16: half their machine eps


def tiny_config(**overrides) -> MHCConfig:
    """A 3-layer mHC config (n = 4 streams of width 48, GQA 4 / 2 heads), small enough for fast CPU tests."""
    return MHCConfig(**{**TINY, "hc_mult": 4, **overrides})


def tiny_llama_config(**overrides) -> LlamaConfig:
    """The Llama config matching :func:`tiny_config`."""
    return LlamaConfig(**{**TINY, **overrides})


def randomise_mhc(model: MHCForCausalLM, seed: int = 0) -> MHCForCausalLM:
    """Move base and scale off their init (0 and 1) and make fn larger, so that pre, post and comb are far from
    uniform and differ from token to token (a wrong formula or transposition then shows)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".fn", ".hc_fn")):
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif name.endswith((".base", ".hc_base")):
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.endswith((".scale", ".hc_scale")):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
    return model


def op_inputs(batch: int, tokens: int, n: int, dim: int, dtype: torch.dtype = torch.float64, head: bool = False,
              seed: int = 0, requires_grad: bool = True) -> tuple[torch.Tensor, ...]:
    """``(streams [B, T, n, D], fn, base, scale)`` with projections of order 1 (``fn . RMSNorm(x)`` ~ N(0, 1)),
    random biases and scales around 1: the weights are far from uniform and the Sinkhorn loop has work to do."""
    generator = torch.Generator().manual_seed(seed)
    rows = n if head else (2 + n) * n
    tensors = (
        torch.randn(batch, tokens, n, dim, generator=generator),
        torch.randn(rows, n * dim, generator=generator) / (n * dim) ** 0.5,
        torch.randn(rows, generator=generator),
        1 + 0.3 * torch.randn(1 if head else 3, generator=generator),
    )
    return tuple(t.to(dtype).requires_grad_(requires_grad) for t in tensors)


def mix_inputs(batch: int, tokens: int, n: int, dim: int, dtype: torch.dtype = torch.float64, seed: int = 0,
               requires_grad: bool = True) -> tuple[torch.Tensor, ...]:
    """``(streams [B, T, n, D], output [B, T, D], post [B, T, n], comb [B, T, n, n])``, comb not symmetric."""
    generator = torch.Generator().manual_seed(seed)
    tensors = (
        torch.randn(batch, tokens, n, dim, generator=generator),
        torch.randn(batch, tokens, dim, generator=generator),
        2 * torch.rand(batch, tokens, n, generator=generator),
        torch.rand(batch, tokens, n, n, generator=generator),
    )
    return tuple(t.to(dtype).requires_grad_(requires_grad) for t in tensors)


def transformers_modules(n: int, dim: int, iters: int, eps: float, norm_eps: float, fn, base, scale, head_fn,
                         head_base, head_scale):
    """transformers' ``DeepseekV4HyperConnection`` and ``DeepseekV4HyperHead`` holding the given parameters (in
    their dtype)."""
    config = DeepseekV4Config(hidden_size=dim, hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=eps, rms_norm_eps=norm_eps)
    connection, head = DeepseekV4HyperConnection(config), DeepseekV4HyperHead(config)
    for module, values in ((connection, (fn, base, scale)), (head, (head_fn, head_base, head_scale))):
        for param, value in zip(module.parameters(), values):
            param.data = value.detach().clone()
    return connection, head


@contextlib.contextmanager
def float_keeps_float64():
    """``Tensor.float()`` leaves float64 tensors alone inside the block.

    transformers' DeepSeek-V4 hyper-connection modules call ``.float()`` on their inputs and parameters (float32 for
    any input dtype); with this, the same code runs in float64, so its formula can be compared with ours to
    float64 rounding.
    """
    original = torch.Tensor.float

    def keep_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = keep_float64
    try:
        yield
    finally:
        torch.Tensor.float = original


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` in float64 (the error relative to the tensor's scale)."""
    want = want.detach().double()
    return ((got.detach().double() - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()
