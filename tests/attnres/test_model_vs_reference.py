"""The model on the torch backend against the reference backend (the paper's loop), on the inputs an earlier
review probed on the removed fast paths, where a path that keeps state or takes shortcuts could go wrong: every
generation mode with left padding, batch and dtype changes between forwards, ``inference_mode``, hidden states and
depth weights, each call's own eps, a parameter changed inside a forward, PEFT ``modules_to_save``, calls in
another dtype than the model, and training under CPU autocast.

Gates: float64 models agree with the reference to float64 rounding, except that transformers' Llama RMSNorms
compute in float32 even in a float64 model, so a rounding difference can flip a float32 rounding in the next
sub-layer: logits are compared to ``64 eps32`` times their scale; float32 models to ``256 eps32``.
"""

from __future__ import annotations

import pytest
import torch

from depthfusion_hf.models.modeling_attnres import AttnResForCausalLM, AttnResMix

from .helpers import randomise_attnres, set_small_numel, tiny_config

EPS32 = torch.finfo(torch.float32).eps


def make_model(block_size=3, dtype=torch.float64, seed=0) -> AttnResForCausalLM:
    torch.manual_seed(seed)
    model = AttnResForCausalLM(tiny_config(attnres_block_size=block_size)).to(dtype).eval()
    randomise_attnres(model, seed=seed)
    return model


def ids_of(shape, seed=1) -> torch.Tensor:
    return torch.randint(3, 97, shape, generator=torch.Generator().manual_seed(seed))


def logits_on(model, ids, backend, monkeypatch, grad=False, **kwargs) -> torch.Tensor:
    monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
    with torch.set_grad_enabled(grad):
        return model(ids, use_cache=False, **kwargs).logits.detach()


def assert_close(got, want, ulps=64):
    assert got.shape == want.shape
    assert (got - want).abs().max() <= ulps * EPS32 * want.abs().max(), (got - want).abs().max()


@pytest.mark.parametrize(
    "mode",
    [dict(do_sample=False), dict(do_sample=False, num_beams=3, num_return_sequences=2), dict(do_sample=True, top_k=5)],
    ids=["greedy", "beam", "sample"],
)
def test_generate_modes_with_left_padding_match_reference(mode, monkeypatch):
    """Greedy, beam search (the batch grows to B * beams and the cache is reordered) and sampling, with left
    padding: the same sequences and per-step scores as the reference backend."""
    model = make_model(3)
    ids = ids_of((2, 5))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = model.config.pad_token_id
    out = {}
    for backend in ("torch", "reference"):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        torch.manual_seed(7)
        out[backend] = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                                      output_scores=True, return_dict_in_generate=True,
                                      pad_token_id=model.config.pad_token_id, **mode)
    assert torch.equal(out["torch"].sequences, out["reference"].sequences)
    for got, want in zip(out["torch"].scores, out["reference"].scores):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got))
        assert_close(got[finite], want[finite])


def test_batch_size_and_dtype_changing_between_forwards(monkeypatch):
    model = make_model(None, torch.float32)
    for dtype, shape in [(torch.float32, (1, 1)), (torch.float64, (2, 2)), (torch.float32, (3, 1))]:
        model.to(dtype)
        ids = ids_of(shape, seed=shape[0] * 10 + shape[1])
        got = logits_on(model, ids, "torch", monkeypatch)
        assert got.dtype == dtype
        assert_close(got, logits_on(model, ids, "reference", monkeypatch), 64 if dtype == torch.float64 else 256)


def test_inference_mode_then_no_grad(monkeypatch):
    """``torch.inference_mode`` (before: MoDA failed there) and ``no_grad`` forwards, in turns."""
    model = make_model(3)
    ids = ids_of((1, 3))
    want = logits_on(model, ids, "reference", monkeypatch)
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "torch")
    for context in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with context():
            assert_close(model(ids, use_cache=False).logits, want)
    with torch.inference_mode():  # a model whose parameters are inference tensors
        frozen = make_model(2)
    assert_close(logits_on(frozen, ids, "torch", monkeypatch), logits_on(frozen, ids, "reference", monkeypatch))


def test_output_hidden_states_and_depth_weights_match_reference(monkeypatch):
    model = make_model(3)
    ids = ids_of((2, 2))
    got, want = [], []
    for backend, into in (("torch", got), ("reference", want)):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        with torch.no_grad():
            into.extend(model.model(ids, use_cache=False, output_hidden_states=True).hidden_states)
        into.append(model.depth_attention_weights(ids))
    assert len(got) == len(want) == model.config.num_hidden_layers + 2
    for g, w in zip(got, want):
        assert_close(g, w)


@pytest.mark.parametrize("forward", ["stacked", "list"])
def test_each_call_uses_its_own_eps(forward, monkeypatch):
    """``config.rms_norm_eps`` changed after construction (the calls keep the eps they were built with), and one
    call's ``eps`` set apart from the others: every backend reads each call's ``eps``."""
    if forward == "list":
        set_small_numel(monkeypatch, -1)
    model = make_model(2)
    model.config.rms_norm_eps = 0.5
    model.model.layers[2].output_res.eps = 0.25
    ids = ids_of((2, 3))
    assert_close(logits_on(model, ids, "torch", monkeypatch, grad=True),
                 logits_on(model, ids, "reference", monkeypatch, grad=True))


def test_parameter_changed_in_place_inside_a_forward(monkeypatch):
    """A pre-hook on layer 2 changes layer 3's pseudo-query in place: the calls that follow read the new value."""
    model = make_model(3)
    query = model.model.layers[3].mlp_res.query
    before = query.detach().clone()

    def flip(module, args):
        with torch.no_grad():
            query.copy_(-before)

    model.model.layers[2].register_forward_pre_hook(flip)
    ids = ids_of((2, 3))
    got = {}
    for backend in ("torch", "reference"):
        with torch.no_grad():
            query.copy_(before)
        got[backend] = logits_on(model, ids, backend, monkeypatch)
    assert_close(got["torch"], got["reference"])
    assert not torch.equal(query.detach(), before)


@pytest.mark.parametrize("disabled", [False, True], ids=["adapter", "disabled"])
def test_peft_modules_to_save_copies(disabled, monkeypatch):
    """PEFT ``modules_to_save`` on every call, the adapter's copies changed: with the adapter and under
    ``disable_adapter()`` the reference backend's logits."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(make_model(3), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                          modules_to_save=["mlp_res", "output_res"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".modules_to_save." in name and name.endswith(".query"):
                param.mul_(-1.5)
    ids = ids_of((2, 1))
    got = {}
    for backend in ("torch", "reference"):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        with torch.no_grad(), peft_model.disable_adapter() if disabled else torch.enable_grad():
            got[backend] = peft_model(input_ids=ids).logits
    assert_close(got["torch"], got["reference"])


@pytest.mark.parametrize(("model_dtype", "call_dtype"), [(torch.float32, torch.bfloat16), (torch.float64,
                                                                                            torch.float32)])
def test_calls_in_another_dtype_than_the_model(model_dtype, call_dtype, monkeypatch):
    """Calls (pseudo-query, key-norm weight) in a coarser dtype than the model: computed in the promoted dtype,
    the model's, on every backend; the first call's weights agree to the model dtype's rounding."""
    model = make_model(3, model_dtype)
    for layer in model.model.layers:
        layer.mlp_res.to(call_dtype)
        layer.output_res.to(call_dtype)
    ids = ids_of((2, 3))
    first = {}
    for backend in ("torch", "reference"):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        with torch.no_grad():
            first[backend] = model.model(ids, use_cache=False, output_depth_weights=True).depth_weights[0]
    assert first["torch"].dtype == first["reference"].dtype == torch.promote_types(model_dtype, torch.float32)
    assert (first["torch"] - first["reference"]).abs().max() <= 64 * torch.finfo(model_dtype).eps


def record_mix_dtypes(model) -> list[torch.dtype]:
    """The dtype of every AttnRes call's output (the residual stream) from now on."""
    seen = []
    for module in model.modules():
        if isinstance(module, AttnResMix):
            module.register_forward_hook(lambda mod, args, out: seen.append(out[0].dtype))
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("forward", ["stacked", "list"])
@pytest.mark.parametrize("block_size", [None, 3], ids=["full", "block3"])
def test_training_under_cpu_autocast(dtype, forward, block_size, monkeypatch):
    """A training step under CPU autocast (half-precision sub-layer outputs beside the float32 embedding and
    parameters): the op computes in the promoted dtype, fp32, so the residual stream (every call's output) stays
    fp32 as a Llama's does (before: it was rounded to the autocast dtype at every call); the torch backend's loss
    and every gradient equal the reference backend's to the half type's rounding, and both are as close to the
    float64 model (the same function without autocast)."""
    if forward == "list":
        set_small_numel(monkeypatch, -1)
    ids = ids_of((2, 6))

    def loss_and_grads(model, autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            out = model.model(ids, use_cache=False, output_depth_weights=True)
            logits = model.lm_head(out.last_hidden_state).float()
            loss = logits.logsumexp(-1).mean() - logits[..., 3].mean() + out.depth_weights[0][..., 0].mean()
        loss.backward()
        return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}

    model = make_model(block_size, torch.float32).train()
    mixed = record_mix_dtypes(model)
    results = {}
    for backend in ("torch", "reference"):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        results[backend] = loss_and_grads(model, True)
    assert len(mixed) == 2 * 2 * model.config.num_hidden_layers and set(mixed) == {torch.float32}
    _, truth = loss_and_grads(make_model(block_size, torch.float64).train(), False)
    eps = torch.finfo(dtype).eps
    (loss, grads), (ref_loss, ref_grads) = results["torch"], results["reference"]
    assert abs(loss - ref_loss) <= 16 * eps * abs(ref_loss)
    for name, g in ref_grads.items():
        assert (grads[name] - g).norm() <= 32 * eps * g.norm(), name
        assert (grads[name] - truth[name]).norm() <= 2 * (g - truth[name]).norm() + 4 * eps * g.norm(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [None, 3], ids=["full", "block3"])
def test_generate_under_cpu_autocast(dtype, block_size, monkeypatch):
    """Cached ``generate`` under CPU autocast (an fp32 embedding and half-precision outputs, each read in its own
    dtype; every call computes and returns fp32): the reference backend's tokens, and per-step scores to the half
    type's rounding."""
    model = make_model(block_size, torch.float32)
    mixed = record_mix_dtypes(model)
    ids = ids_of((2, 5))
    out = {}
    for backend in ("torch", "reference"):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        with torch.autocast("cpu", dtype=dtype):
            out[backend] = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                          output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out["torch"].sequences, out["reference"].sequences)
    assert mixed and set(mixed) == {torch.float32}
    for got, want in zip(out["torch"].scores, out["reference"].scores):
        assert (got - want).abs().max() <= 8 * torch.finfo(dtype).eps * want.abs().max()
