"""Training with gradients over many tokens: each source scored for its calls once, when it is written.

The model takes every call's key once per forward (``call_keys``), gives each written source its logit rows
(``source_logit_rows``: one product for the calls that read that version of it) and runs each call from them
(``attention_residual_from_rows``). Checked against the reference backend (the loop over sources): the loss,
every parameter gradient, the softmax weights and their gradients, for full and block AttnRes (block sizes
that divide the depth and one that does not), with gradient checkpointing (reentrant and not), double
backward, and a call whose parameters are not those of the keys. The model checks run on the list path
(``SMALL_NUMEL = -1``), where the rows are used.
"""

from __future__ import annotations

import pytest
import torch

from depthfusion_hf.models.attnres import AttnResForCausalLM
from depthfusion_hf.models.attnres.attnres import attnres_reference
from depthfusion_hf.models.attnres.shared_sources import attention_residual_from_rows, call_keys, source_logit_rows

from .helpers import randomise_attnres, tiny_config

EPS32 = torch.finfo(torch.float32).eps


def loss_and_grads(model, ids, weight_loss: torch.Tensor | None = None):
    """The LM loss (plus ``sum(weight_loss[c] * alpha_c)`` over the calls' softmax weights when given) and every
    parameter gradient."""
    model.zero_grad(set_to_none=True)
    out = model.model(ids, output_depth_weights=weight_loss is not None)
    logits = model.lm_head(out.last_hidden_state)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    if weight_loss is not None:
        for c, alpha in enumerate(out.depth_weights):
            loss = loss + (alpha * weight_loss[c, : alpha.shape[-1]]).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_function(got, want):
    """Gate (fp32): the same terms summed in other orders, so the loss agrees to 64 eps relative and each
    gradient to ``64 eps sqrt(n)`` relative in norm (n its element count: random-walk rounding growth)."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert abs(loss - ref_loss) <= 64 * EPS32 * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        err = (grads[name] - g).norm() / g.norm().clamp_min(1e-30)
        assert err <= 64 * EPS32 * g.numel() ** 0.5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("with_weights", [False, True], ids=["lm", "lm+weights"])
@pytest.mark.parametrize("block_size", [None, 2, 3, 8], ids=lambda s: f"block{s}")
def test_model_matches_reference_backend(list_path, row_calls, monkeypatch, block_size, with_weights):
    """Loss and every parameter gradient (also through the softmax weights) equal the reference loop's; every
    call runs from the rows."""
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=block_size))
    randomise_attnres(model)
    ids = torch.randint(3, 97, (2, 9))
    weight_loss = torch.randn(2 * model.config.num_hidden_layers, 2 * model.config.num_hidden_layers + 1)
    got = loss_and_grads(model, ids, weight_loss if with_weights else None)
    assert row_calls["rows"] == 2 * model.config.num_hidden_layers
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
    assert_same_function(got, loss_and_grads(model, ids, weight_loss if with_weights else None))
    assert row_calls["rows"] == 2 * model.config.num_hidden_layers  # the reference backend does not use them


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("block_size", [None, 3], ids=lambda s: f"block{s}")
def test_checkpointing_gives_the_same_gradients(list_path, block_size, reentrant):
    """Gradient checkpointing (the rows and keys travel as positional tensors): the gradients without it."""
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=block_size))
    randomise_attnres(model)
    ids = torch.randint(3, 97, (2, 8))
    plain = loss_and_grads(model, ids)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    checkpointed = loss_and_grads(model, ids)
    assert_same_function(checkpointed, plain)
    assert all(g.abs().sum() > 0 for n, g in checkpointed[1].items() if n.endswith((".query", ".key_norm_weight")))


def test_a_call_with_other_parameters_ignores_the_rows(list_path, row_calls, monkeypatch):
    """A call whose module was swapped after the keys were taken scores its sources itself, with its own
    parameters: the loss and gradients are those of the swapped model on the reference backend."""
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=None))
    randomise_attnres(model)
    ids = torch.randint(3, 97, (2, 7))
    mix = model.model.layers[1].output_res
    swapped = type(mix)(mix.query.numel(), mix.eps)
    with torch.no_grad():
        swapped.query.copy_(-mix.query)
    original = type(model.model).start_logit_rows

    def start_then_swap(self, *args):
        rows = original(self, *args)
        model.model.layers[1].output_res = swapped
        return rows

    monkeypatch.setattr(type(model.model), "start_logit_rows", start_then_swap)
    got = loss_and_grads(model, ids)
    assert row_calls["rows"] == 2 * model.config.num_hidden_layers - 1
    monkeypatch.setattr(type(model.model), "start_logit_rows", original)
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
    assert_same_function(got, loss_and_grads(model, ids))


def chain_inputs(n_src: int, n_calls: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(7)
    queries = [(0.7 * torch.randn(5, generator=gen, dtype=dtype)).requires_grad_() for _ in range(n_calls)]
    weights = [(1 + 0.3 * torch.randn(5, generator=gen, dtype=dtype)).requires_grad_() for _ in range(n_calls)]
    sources = [torch.randn(2, 3, 5, generator=gen, dtype=dtype).requires_grad_() for _ in range(n_src)]
    return queries, weights, sources


def rows_path(queries, weights, sources, call):
    """Call ``call`` through keys, rows (every call scored) and ``attention_residual_from_rows``."""
    keys = call_keys(queries, weights)
    rows = [source_logit_rows(v, keys, 1e-6) for v in sources]
    return attention_residual_from_rows([call] * len(sources), sources, rows, True)


def test_rows_path_equals_the_op_in_float64():
    """Values, weights and every gradient of keys + rows + call equal the reference op's (float64 rounding)."""
    queries, weights, sources = chain_inputs(4, 3)
    inputs = [*queries, *weights, *sources]
    for call in range(3):
        h, alpha = rows_path(queries, weights, sources, call)
        ref_h, ref_alpha = attnres_reference(queries[call], sources, weights[call], 1e-6)
        torch.testing.assert_close(h, ref_h, rtol=0, atol=64 * torch.finfo(torch.float64).eps)
        torch.testing.assert_close(alpha, ref_alpha, rtol=0, atol=64 * torch.finfo(torch.float64).eps)
        gen = torch.Generator().manual_seed(call)
        dh, da = torch.randn(h.shape, generator=gen, dtype=h.dtype), torch.randn(alpha.shape, generator=gen,
                                                                                   dtype=h.dtype)
        got = torch.autograd.grad((h, alpha), inputs, (dh, da), allow_unused=True)
        want = torch.autograd.grad((ref_h, ref_alpha), inputs, (dh, da), allow_unused=True)
        for g, w in zip(got, want):
            if w is None:
                assert g is None or g.abs().max() == 0
            else:
                torch.testing.assert_close(g, w, rtol=0, atol=256 * torch.finfo(torch.float64).eps)


def test_rows_path_gradcheck_and_gradgradcheck():
    """First and second derivatives of the rows path (the custom backward and its double-backward branch)."""
    queries, weights, sources = chain_inputs(3, 2)

    def fn(q0, q1, g0, g1, *xs):
        return rows_path([q0, q1], [g0, g1], list(xs), 1)

    inputs = (*queries, *weights, *sources)
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_peft_adapter_copies_of_the_calls_run_from_the_rows(list_path, row_calls, monkeypatch):
    """LoRA with ``modules_to_save`` on the calls: the keys are taken from the active adapter's copies (which
    differ from the base calls here), every call runs from the rows, and loss and gradients equal the
    reference backend's."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AttnResForCausalLM(tiny_config(attnres_block_size=3))
    randomise_attnres(base)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=["q_proj"],
                        modules_to_save=["mlp_res", "output_res"])
    model = get_peft_model(base, config).train()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name and name.endswith(".query"):
                param.mul_(-1.5)
    ids = torch.randint(3, 97, (2, 7))

    def run():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    got = run()
    assert row_calls["rows"] == 2 * base.config.num_hidden_layers
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
    assert_same_function(got, run())


def test_bf16_rows_path_matches_the_reference_backend(list_path, monkeypatch):
    """bf16 parameters and activations: the rows and softmax run in float32 as on the reference backend, so the
    two differ only where a float32 reassociation flips a bf16 rounding of a sub-layer output. Gate: the loss
    to ``16 eps_bf16`` relative and every gradient to ``16 eps_bf16`` relative in norm (measured: loss equal, worst
    gradient 1.8 eps_bf16)."""
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=3))
    randomise_attnres(model)
    model = model.to(torch.bfloat16)
    ids = torch.randint(3, 97, (2, 9))
    loss, grads = loss_and_grads(model, ids)
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "reference")
    ref_loss, ref_grads = loss_and_grads(model, ids)
    eps = torch.finfo(torch.bfloat16).eps
    assert abs(loss.float() - ref_loss.float()) <= 16 * eps * abs(ref_loss.float())
    for name, g in ref_grads.items():
        assert grads[name].dtype == torch.bfloat16
        err = (grads[name].float() - g.float()).norm() / g.float().norm().clamp_min(1e-30)
        assert err <= 16 * eps, f"{name}: relative error {err:.2e}"
