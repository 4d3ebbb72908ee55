"""Step ``models``: a bf16-autocast training step of every family against the fp32 PyTorch backend.

For each family (DenseFormer, MoDA, AttnRes block and full, mHC, DWAtt; transformers' Llama as the control) one model
of realistic width (d_model 1024, 8 heads of 128, GQA 2, 8 layers, T = 2048, a left-padded batch of 4) is run
three times on the same weights and batch: fp32 with ``op_backend="torch"`` (the reference), bf16 autocast with
``op_backend="triton"`` (what ``Trainer(bf16=True)`` runs on CUDA), and bf16 autocast with ``op_backend="torch"``.
The loss and the gradient of every parameter (as one vector) of the Triton run must be within
:func:`common.tolerance` of the reference: twice the larger of the PyTorch run's own autocast error and bf16's unit
roundoff. Then one AdamW step under autocast must leave a finite loss.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEVICE, Result, relative_error, size, step_main, tolerance  # noqa: E402

DECODER = dict(vocab_size=size(32000, 128), hidden_size=size(1024, 64), intermediate_size=size(2816, 96),
               num_hidden_layers=size(8, 2), num_attention_heads=size(8, 4), num_key_value_heads=size(4, 2),
               head_dim=size(128, 16), max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
BATCH, SEQ = size(4, 2), size(2048, 24)
BERT = dict(model_type="bert", vocab_size=size(30522, 128), hidden_size=size(512, 32), num_hidden_layers=size(6, 2),
            num_attention_heads=size(8, 4), intermediate_size=size(2048, 64), max_position_embeddings=512)


def build(family: str):
    """``(model in fp32 on CUDA in eval mode, has an op backend)``; eval mode: no dropout (BERT's), so the three
    runs differ only by their arithmetic."""
    model, has_backend = _build(family)
    return model.eval(), has_backend


def _build(family: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import depthfusion_hf as dfh

    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**DECODER)).to(DEVICE), False
    if family == "dwatt":
        config = dfh.DWAttConfig(backbone_config=dict(BERT), num_labels=9)
        return dfh.DWAttForTokenClassification(config).to(DEVICE), False
    config = {"denseformer": lambda: dfh.DenseFormerConfig(**DECODER, dwa_dilation=1, dwa_period=1),
              "moda": lambda: dfh.MoDAConfig(**DECODER),
              "attnres-block": lambda: dfh.AttnResConfig(**DECODER, attnres_block_size=4),
              "attnres-full": lambda: dfh.AttnResConfig(**DECODER),
              "mhc": lambda: dfh.MHCConfig(**DECODER)}[family]()
    return dfh.get_family(config.model_type).task_model_class(config).to(DEVICE), True


def batch_for(family: str):
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    seq = size(512, 16) if family == "dwatt" else SEQ
    vocab = BERT["vocab_size"] if family == "dwatt" else DECODER["vocab_size"]
    ids = torch.randint(3, vocab, (BATCH, seq), generator=gen, device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, : seq // 4] = 0  # left padding in the first row
    labels = torch.randint(0, 9, (BATCH, seq), generator=gen, device=DEVICE) if family == "dwatt" else ids.clone()
    labels[mask == 0] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def train_step(model, batch, autocast: bool):
    """``(loss, flat gradient)`` of one forward + backward."""
    import torch

    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None])
    return loss.detach().double(), grad


def family_check(result: Result, family: str) -> None:
    import torch

    model, has_backend = build(family)
    batch = batch_for(family)
    if has_backend:
        model.config.op_backend = "torch"
    loss_ref, grad_ref = train_step(model, batch, autocast=False)
    loss_torch, grad_torch = train_step(model, batch, autocast=True)
    name = f"{family}: bf16 autocast training step"
    if not has_backend:  # the control / a family without a kernel: its autocast error, for context
        result.check(f"{name} (PyTorch only) is finite", bool(torch.isfinite(loss_torch) and torch.isfinite(grad_torch)
                                                             .all()), loss_error=relative_error(loss_torch, loss_ref),
                     grad_error=relative_error(grad_torch, grad_ref))
        return
    tri = copy.deepcopy(model)
    tri.config.op_backend = "triton"
    loss_tri, grad_tri = train_step(tri, batch, autocast=True)
    for what, t, b, r in (("loss", loss_tri, loss_torch, loss_ref), ("gradients", grad_tri, grad_torch, grad_ref)):
        e_t, e_b = relative_error(t, r), relative_error(b, r)
        bound = tolerance(torch.bfloat16, e_b)
        finite = bool(torch.isfinite(t).all())
        result.check(f"{name}: {what}, Triton vs fp32 PyTorch", finite and e_t <= bound, error_triton=e_t,
                     error_torch_autocast=e_b, bound=bound, finite=finite)
    optimizer = torch.optim.AdamW(tri.parameters(), lr=1e-4)
    optimizer.step()
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        after = tri(**batch).loss
    result.check(f"{name}: loss finite after an AdamW step", bool(torch.isfinite(after)), loss=after.item(),
                 before=loss_tri.item())


def run(result: Result, args) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for family in ("moda", "attnres-block", "attnres-full", "denseformer", "mhc", "llama", "dwatt"):
        result.attempt(f"{family}: bf16 autocast training step", lambda f=family: family_check(result, f))


if __name__ == "__main__":
    step_main(run)
