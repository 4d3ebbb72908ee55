"""A MoDA model end to end through the Triton backend (interpreted on CPU): logits, gradients, cached generation.

Triton reads ``TRITON_INTERPRET`` when its kernels are imported, so the model runs in a child process with
``TRITON_INTERPRET=1`` and ``DEPTHFUSION_BACKEND`` switched between ``torch`` and ``triton`` there (the model
resolves the backend once per forward pass, from the environment). fp32 runs on the kernels with TF32 allowed
(``torch.set_float32_matmul_precision("high")``; the interpreter's dots are fp32 either way), and a bf16 autocast
training step (RoPE leaves q and k in fp32, v in bf16: one compute dtype at the op's boundary) runs on them too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, os, torch
torch.set_float32_matmul_precision("high")  # the kernels' fp32 dots are TF32: allowed, else fp32 goes to torch
from tests.family_cases import tiny_model
from depthfusion_hf.models import moda_attention
assert moda_attention.triton_moda_forward is not None, "the Triton kernels did not import under TRITON_INTERPRET=1"
ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
mask[0, :2] = 0
results = {}
for backend in ("torch", "triton"):
    os.environ["DEPTHFUSION_BACKEND"] = backend
    model = tiny_model("moda", seed=3).train()
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        generated = model.generate(ids[1:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
        cached = model(ids[1:]).logits
    model.train().zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model(ids, attention_mask=mask, labels=ids)
    bf16.loss.backward()
    results[backend] = (out.logits.detach(), grads, generated, cached, bf16.logits.detach().float())
(lt, gt, st, ct, bt), (lr, gr, sr, cr, br) = results["torch"], results["triton"]
keep = mask.bool()
report = {
    "logits_max": lt.abs().max().item(),
    "logits_diff": (lt - lr)[keep].abs().max().item(),
    "grad_rel": max(((gr[n] - g).norm() / g.norm()).item() for n, g in gt.items()),
    "ffn_grad": gr["model.layers.0.ffn_kv_proj.weight"].abs().max().item(),
    "eval_diff": (ct - cr).abs().max().item(),
    "same_generation": bool(torch.equal(st, sr)),
    "bf16_logits_diff": (bt - br)[keep].abs().max().item(),
}
print("REPORT", json.dumps(report))
"""


@pytest.mark.integration
def test_model_through_interpreted_triton_matches_torch_backend():
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("DEPTHFUSION_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.split("REPORT", 1)[1])
    # Two fp32 kernels with different summation orders through 4 layers (measured: logits 3 ulps of 1,
    # gradients 9 eps relative in norm); the gates leave about a factor 10.
    eps = 2.0**-23
    assert report["logits_diff"] <= 32 * eps * max(report["logits_max"], 1.0), report
    assert report["eval_diff"] <= 32 * eps * max(report["logits_max"], 1.0), report
    assert report["grad_rel"] <= 128 * eps, report
    assert report["ffn_grad"] > 0, report
    assert report["same_generation"], report
    # bf16: both backends round q, k, v and P to bf16 (8 bits), differently; 4 bf16 eps of the logits' size
    assert report["bf16_logits_diff"] <= 4 * 2.0**-7 * max(report["logits_max"], 1.0), report
