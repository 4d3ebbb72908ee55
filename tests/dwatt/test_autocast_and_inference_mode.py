"""DWAtt under bf16 / fp16 autocast on CPU (a ``Trainer(bf16=True)`` step) and under ``torch.inference_mode()``."""

import copy

import pytest
import torch

from tests.kernels._dwa_cases import rel_rms

from .helpers import tiny_model

AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]


def perturbed_model(fusion: str):
    """A tiny model in training mode without dropout (autocast and fp32 runs must see the same network), its
    parameters moved off their initial values (zero biases and unit norms would hide a wrong dtype path)."""
    torch.manual_seed(0)
    model = tiny_model(fusion).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.config.backbone_config.attention_probs_dropout_prob = 0.0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 30, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = torch.randint(0, 5, (2, 12), generator=gen).masked_fill(mask == 0, -100)
    return ids, mask, labels


@pytest.mark.parametrize("fusion", ["dwatt", "concat", "last", "last_ln"])
@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
def test_training_step_under_autocast_matches_fp32(fusion, dtype):
    """Logits and every gradient under autocast against the same fp32 model, then an AdamW step.

    With u the unit roundoff of ``dtype``: the logits pass ~10 half-precision matmuls (measured <= 1.2 u): below 4 u.
    A gradient passes each of them twice (measured <= 6 u relative for gradients of the model's typical size);
    gradients far below that size (attention query/key weights, 1e-4 of the largest here) lose relative accuracy
    to cancellation, so each is compared at the larger of its own RMS and the whole gradient's: below 16 u.
    """
    u = torch.finfo(dtype).eps / 2
    model = perturbed_model(fusion)
    fp32, amp = copy.deepcopy(model), copy.deepcopy(model)
    ids, mask, labels = batch()
    ref = fp32(input_ids=ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    with torch.autocast("cpu", dtype=dtype):
        out = amp(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits.dtype == dtype
    assert rel_rms(out.logits, ref.logits) <= 4 * u
    out.loss.backward()
    ref_grads = {name: p.grad for name, p in fp32.named_parameters() if p.grad is not None}
    scale = torch.cat([g.flatten() for g in ref_grads.values()]).double().pow(2).mean().sqrt()
    for name, p in amp.named_parameters():
        if name not in ref_grads:
            continue
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        want = ref_grads[name].double()
        err = (p.grad.double() - want).pow(2).mean().sqrt()
        assert err <= 16 * u * max(want.pow(2).mean().sqrt(), scale), name
    before = amp.classifier.weight.detach().clone()
    torch.optim.AdamW(amp.parameters(), lr=1e-2).step()
    assert not torch.equal(amp.classifier.weight.detach(), before)


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
def test_deeper_baseline_trains_under_autocast(dtype):
    """The deeper baseline is torch's own TransformerEncoderLayer; its small, cancelling attention output makes
    half precision ill-conditioned on these tiny random weights (the fp16 self-attention block alone differs by
    ~20 % from fp32, with SDPA itself accurate to 0.5 u), so only the step itself is checked here."""
    amp = perturbed_model("deeper")
    ids, mask, labels = batch()
    with torch.autocast("cpu", dtype=dtype):
        out = amp(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits.dtype == dtype and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and bool(torch.isfinite(p.grad).all())
               for p in amp.parameters() if p.requires_grad and p.grad is not None)
    assert amp.fusion.layers[0].linear1.weight.grad is not None


@pytest.mark.parametrize("fusion", ["dwatt", "deeper"])
def test_inference_mode_equals_no_grad(fusion):
    model = tiny_model(fusion)
    ids, mask, _ = batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_depth_attentions=True)
    with torch.inference_mode():
        got = model(input_ids=ids, attention_mask=mask, output_depth_attentions=True)
    assert torch.equal(got.logits, want.logits)
    if fusion == "dwatt":
        assert torch.equal(got.depth_attentions, want.depth_attentions)
