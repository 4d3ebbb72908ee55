"""DenseFormer under bf16 / fp16 autocast on CPU (what ``Trainer(bf16=True)`` and TRL's trainers run) and under
``torch.inference_mode()``: a training step, cached generation, and the numbers against the fp32 model.

Under autocast the DWA computes in the promoted dtype of its sources (the op's boundary rule: a residual stream,
like a Llama's x + f(x)): the embedding X_0 is fp32 and later block outputs are half precision, so every DWA step
reads mixed dtypes and its output, the residual stream, stays fp32.
"""

import copy

import pytest
import torch

from depthfusion_hf import DenseFormerForCausalLM
from tests.causal_lm_checks import generate
from tests.kernels._dwa_cases import rel_rms

from .helpers import randomise_dwa, tiny_config

AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = DenseFormerForCausalLM(tiny_config(dwa_dilation=2, dwa_period=1))
    randomise_dwa(m, seed=1)
    return m


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
def test_training_step_under_autocast_matches_fp32(model, dtype):
    """Loss, logits and every gradient under autocast against the same fp32 model; then an AdamW step.

    Bounds with u the unit roundoff of ``dtype``: the ~15 roundings to half precision on the way to the logits
    (matmul inputs and outputs) add independent relative errors of rms u / sqrt(3): about 2.2 u in all
    (measured 1.5 u in bf16 and 1.9 u in fp16 with the residual stream in fp32, as the same Llama's: 1.3 u), so
    below 4 u. Gradients pass every block twice (~70 roundings; measured <= 3.8 u in bf16 and 7.0 u in fp16,
    Llama 3.8 u and 9.3 u): below 16 u.
    """
    u = torch.finfo(dtype).eps / 2
    fp32 = copy.deepcopy(model).train()
    amp = copy.deepcopy(model).train()
    ids = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = fp32(ids, labels=ids)
    ref.loss.backward()
    with torch.autocast("cpu", dtype=dtype):
        out = amp(ids, labels=ids)
    assert out.logits.dtype == dtype
    assert rel_rms(out.logits, ref.logits) <= 4 * u
    max_logit_change = (out.logits.float() - ref.logits).abs().max().item()
    assert abs(out.loss.item() - ref.loss.item()) <= 2 * max_logit_change + u * ref.loss.item()
    out.loss.backward()
    grads = dict(amp.named_parameters())
    for name, p in fp32.named_parameters():
        assert grads[name].grad is not None and grads[name].grad.dtype == torch.float32, name
        assert rel_rms(grads[name].grad, p.grad) <= 16 * u, name
    before = amp.model.dwa.alphas.detach().clone()
    torch.optim.AdamW(amp.parameters(), lr=1e-2).step()
    assert not torch.equal(amp.model.dwa.alphas.detach(), before)


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
def test_generate_under_autocast(model, dtype):
    """Cached greedy generation under autocast: each step's scores are the fp32 model's logits for the same prefix
    (one uncached forward over the generated sequence), within the logits bound above."""
    model.eval()
    u = torch.finfo(dtype).eps / 2
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=dtype), torch.no_grad():
        out = generate(model, ids, do_sample=False)
    assert out.sequences.shape == (2, 11)
    with torch.no_grad():
        logits = model(out.sequences).logits[:, 4:-1].float()  # the logits that chose tokens 5..10
    scores = torch.stack(out.scores, dim=1)
    assert rel_rms(scores, logits) <= 4 * u


def test_inference_mode_forward_and_generate(model):
    """``torch.inference_mode()``: the forward equals the no-grad forward, generation gives the same tokens."""
    model.eval()
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        want_generated = generate(model, ids, do_sample=False).sequences
    with torch.inference_mode():
        got = model(ids).logits
        got_generated = generate(model, ids, do_sample=False).sequences
    assert torch.equal(got, want)
    assert torch.equal(got_generated, want_generated)


def test_inference_mode_under_autocast(model):
    model.eval()
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, ids, do_sample=False)
    assert out.sequences.shape == (1, 12)
