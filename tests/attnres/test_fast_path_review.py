"""Adversarial review of the AttnRes fast paths against the reference backend (the loop over sources).

Two paths score each source once, when it is written, with keys ``u_c = w_c * g_c`` taken once per forward: the
decode ``DepthBuffer`` (no gradients, few tokens; reused between forwards) and the training logit rows (gradients,
many tokens; ``SMALL_NUMEL = -1`` here so tiny shapes take them). Each probe runs an input where cached state could
go stale or be computed differently (generation modes, batch or dtype changes between forwards, inference mode,
parameters changed between forwards or inside one, a re-entrant forward, half-precision calls in a float32 model,
a config changed after construction) and compares with the reference backend.

Gates: float64 models agree with the reference to float64 rounding, except that transformers' Llama RMSNorms
compute in float32 even in a float64 model, so a rounding difference can flip a float32 rounding in the next
sub-layer: logits are compared to ``64 eps32`` times their scale (as in test_depth_buffer.py), far below the
changes the probes would cause (>= 1e-4 measured before the fixes). Float32 models use ``256 eps32``.
"""

from __future__ import annotations

import pytest
import torch

from depthfusion_hf.models.attnres import AttnResForCausalLM
from depthfusion_hf.models.attnres.depth_buffer import DepthBuffer

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


@pytest.fixture
def buffer_mixes(monkeypatch):
    """Counts the calls the DepthBuffer computes itself (so a probe knows the fast path ran)."""
    count = {"mix": 0}
    original = DepthBuffer.mix

    def counting(self, *args, **kwargs):
        count["mix"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DepthBuffer, "mix", counting)
    return count


# --- generate(): every mode decodes token by token on the buffer; the reference backend decodes the same -----


@pytest.mark.parametrize(
    "mode",
    [dict(do_sample=False), dict(do_sample=False, num_beams=3, num_return_sequences=2), dict(do_sample=True, top_k=5)],
    ids=["greedy", "beam", "sample"],
)
def test_generate_modes_with_left_padding_match_reference(mode, monkeypatch, buffer_mixes):
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
    assert buffer_mixes["mix"] > 0
    assert torch.equal(out["torch"].sequences, out["reference"].sequences)
    for got, want in zip(out["torch"].scores, out["reference"].scores):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got))
        assert_close(got[finite], want[finite])


def test_batch_size_and_dtype_changing_between_forwards(monkeypatch, buffer_mixes):
    """Forwards alternating batch shapes and dtypes (float32, float64, back to float32) each equal the reference
    forward of the same model state: no buffer of another shape or dtype is reused."""
    model = make_model(None, torch.float32)
    for dtype, shape in [(torch.float32, (1, 1)), (torch.float32, (3, 1)), (torch.float64, (1, 1)),
                         (torch.float64, (2, 2)), (torch.float32, (1, 1)), (torch.float32, (3, 1))]:
        model.to(dtype)
        ids = ids_of(shape, seed=shape[0] * 10 + shape[1])
        got = logits_on(model, ids, "torch", monkeypatch)
        assert got.dtype == dtype
        assert_close(got, logits_on(model, ids, "reference", monkeypatch), 64 if dtype == torch.float64 else 256)
    assert buffer_mixes["mix"] == 6 * 2 * model.config.num_hidden_layers


def test_optimizer_step_between_generate_calls(monkeypatch, buffer_mixes):
    """An optimizer step on the pseudo-queries and key-norm weights between two generate() calls: the second
    decodes with the new parameters (the keys are retaken every forward), as the reference backend does."""
    model = make_model(2)
    ids = ids_of((1, 3))
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "torch")
    model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    params = [p for n, p in model.named_parameters() if n.endswith((".query", ".key_norm_weight"))]
    opt = torch.optim.SGD(params, lr=0.5)
    for p in params:
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(p.numel()))
    opt.step()
    scores = {}
    for backend in ("torch", "reference"):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        scores[backend] = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                         output_scores=True, return_dict_in_generate=True).scores
    assert buffer_mixes["mix"] > 0
    for got, want in zip(scores["torch"], scores["reference"]):
        assert_close(got, want)


def test_inference_mode_then_no_grad_then_inference_mode(monkeypatch, buffer_mixes):
    """A forward under ``torch.inference_mode`` then one under ``torch.no_grad`` (e.g. generate()) reuse one
    buffer: the second must neither fail (in-place writes to inference tensors) nor differ from the reference."""
    model = make_model(3)
    ids = ids_of((1, 1))
    want = logits_on(model, ids, "reference", monkeypatch)
    monkeypatch.setenv("DEPTHFUSION_BACKEND", "torch")
    for context in (torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad):
        with context():
            assert_close(model(ids, use_cache=False).logits, want)
    assert buffer_mixes["mix"] == 4 * 2 * model.config.num_hidden_layers


def test_output_hidden_states_and_depth_weights_match_reference(monkeypatch, buffer_mixes):
    """Every layer's hidden state and the averaged depth weights on the buffer path equal the reference's."""
    model = make_model(3)
    ids = ids_of((2, 2))
    got, want = [], []
    for backend, into in (("torch", got), ("reference", want)):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        with torch.no_grad():
            into.extend(model.model(ids, use_cache=False, output_hidden_states=True).hidden_states)
        into.append(model.depth_attention_weights(ids))
    assert buffer_mixes["mix"] > 0 and len(got) == len(want)
    for g, w in zip(got, want):
        assert_close(g, w)


def test_reentrant_forward_inside_a_hook(monkeypatch, buffer_mixes):
    """A forward of the same model inside a layer's forward hook (same shape: the outer buffer is locked) leaves
    the outer forward's result unchanged, and itself equals the reference."""
    model = make_model(None)
    outer_ids, inner_ids = ids_of((1, 1), 2), ids_of((1, 1), 3)
    want_outer = logits_on(model, outer_ids, "reference", monkeypatch)
    want_inner = logits_on(model, inner_ids, "reference", monkeypatch)
    inner = []

    def hook(module, args, output):
        if not inner:
            inner.append(None)
            inner[0] = model(inner_ids, use_cache=False).logits

    handle = model.model.layers[1].register_forward_hook(hook)
    got_outer = logits_on(model, outer_ids, "torch", monkeypatch)
    handle.remove()
    assert buffer_mixes["mix"] == 2 * 2 * model.config.num_hidden_layers
    assert_close(got_outer, want_outer)
    assert_close(inner[0], want_inner)


def test_two_models_interleaved(monkeypatch):
    """Two models of one shape decoding in turns each give their own reference logits."""
    models = [make_model(3, seed=0), make_model(3, seed=1)]
    ids = ids_of((1, 1))
    want = [logits_on(m, ids, "reference", monkeypatch) for m in models]
    for _ in range(2):
        for m, w in zip(models, want):
            assert_close(logits_on(m, ids, "torch", monkeypatch), w)


def test_half_precision_calls_in_a_float32_model(monkeypatch, buffer_mixes):
    """bfloat16 pseudo-queries and key-norm weights in a float32 model: the keys ``w * g`` are exact in float32
    (as on the reference backend), not rounded to bfloat16 (a 2 % change of the logits before the fix)."""
    model = make_model(3, torch.float32)
    for layer in model.model.layers:
        layer.mlp_res.to(torch.bfloat16)
        layer.output_res.to(torch.bfloat16)
    ids = ids_of((1, 2))
    got = logits_on(model, ids, "torch", monkeypatch)
    assert buffer_mixes["mix"] == 2 * model.config.num_hidden_layers
    assert_close(got, logits_on(model, ids, "reference", monkeypatch), 256)


def change_config_eps(model) -> None:
    model.config.rms_norm_eps = 0.5


def change_one_calls_eps(model) -> None:
    model.model.layers[2].output_res.eps = 0.25


@pytest.mark.parametrize("path", ["buffer", "rows"])
@pytest.mark.parametrize("block_size,change", [(3, change_config_eps), (2, change_one_calls_eps)],
                         ids=["config-eps-after-construction", "one-call-with-its-own-eps"])
def test_each_call_uses_its_own_eps(path, block_size, change, monkeypatch):
    """``config.rms_norm_eps`` changed after construction (every call keeps the eps it was built with), or one
    call's ``eps`` set apart from the others: the reference backend reads each call's ``eps``, and the fast
    paths must too (not the config's, nor one eps for all calls)."""
    model = make_model(block_size)
    change(model)
    if path == "rows":
        set_small_numel(monkeypatch, -1)
    ids = ids_of((2, 3))
    grad = path == "rows"
    got = logits_on(model, ids, "torch", monkeypatch, grad)
    assert_close(got, logits_on(model, ids, "reference", monkeypatch, grad))


@pytest.mark.parametrize("path", ["buffer", "rows"])
def test_parameter_changed_in_place_inside_a_forward(path, monkeypatch):
    """A pre-hook on layer 2 changes layer 3's pseudo-query in place, after the keys were taken: the calls that
    follow read the new value, as on the reference backend (the fast paths must not use the stale key)."""
    model = make_model(3)
    if path == "rows":
        set_small_numel(monkeypatch, -1)
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
        got[backend] = logits_on(model, ids, backend, monkeypatch, grad=path == "rows")
    assert_close(got["torch"], got["reference"])


@pytest.mark.parametrize("block_size", [None, 3])
def test_rows_path_after_an_optimizer_step_and_with_one_token(block_size, monkeypatch):
    """Training on the rows path: after an optimizer step (new keys), and with gradients for a single token,
    the loss and every gradient equal the reference backend's (float64: 64 eps32 relative, as above)."""
    set_small_numel(monkeypatch, -1)
    model = make_model(block_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for shape in [(2, 5), (2, 5), (1, 1)]:
        ids = ids_of(shape, seed=shape[1])
        results = {}
        for backend in ("torch", "reference"):
            monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
            model.zero_grad(set_to_none=True)
            logits = model(ids, use_cache=False).logits
            loss = logits.logsumexp(-1).mean() - logits[..., 3].mean()
            loss.backward()
            results[backend] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None})
        (loss, grads), (ref_loss, ref_grads) = results["torch"], results["reference"]
        assert abs(loss - ref_loss) <= 64 * EPS32 * abs(ref_loss)
        assert grads.keys() == ref_grads.keys()
        # gradients zero in exact arithmetic (attention's q and k at T = 1) are float64 cancellation noise, a few
        # eps64 times the gradient scale: the floor
        floor = 1e3 * torch.finfo(torch.float64).eps * torch.stack([g.norm() for g in ref_grads.values()]).norm()
        for name, g in ref_grads.items():
            assert (grads[name] - g).norm() <= 64 * EPS32 * g.numel() ** 0.5 * g.norm() + floor, name
        opt.step()


def test_config_block_size_changed_after_construction(monkeypatch, buffer_mixes):
    """``config.attnres_block_size`` changed after construction: the layers keep the block size they were built
    with, and the buffer must hold as many sources as they write (before the fix: IndexError past capacity)."""
    model = make_model(None)
    model.config.attnres_block_size = 8
    ids = ids_of((1, 2))
    got = logits_on(model, ids, "torch", monkeypatch)
    assert buffer_mixes["mix"] == 2 * model.config.num_hidden_layers
    assert_close(got, logits_on(model, ids, "reference", monkeypatch))


@pytest.mark.parametrize("disabled", [False, True], ids=["adapter", "disabled"])
def test_peft_modules_to_save_copies_on_the_buffer_path(disabled, monkeypatch):
    """PEFT ``modules_to_save`` on every call, the adapter's copies changed (so they differ from the originals):
    with the adapter and under ``disable_adapter()`` the buffer path gives the reference backend's logits."""
    from peft import LoraConfig, get_peft_model

    model = make_model(3)
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                  modules_to_save=["mlp_res", "output_res"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".modules_to_save." in name and name.endswith(".query"):
                param.mul_(-1.5)
    ids = ids_of((2, 1))
    got = {}
    for backend in ("torch", "reference"):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        with torch.no_grad():
            if disabled:
                with peft_model.disable_adapter():
                    got[backend] = peft_model(input_ids=ids).logits
            else:
                got[backend] = peft_model(input_ids=ids).logits
    assert_close(got["torch"], got["reference"])


def test_train_eval_switch_and_model_built_in_inference_mode(monkeypatch):
    """``train()``/``eval()`` toggled between decoding steps, and a model whose parameters are inference tensors
    (built under ``torch.inference_mode``: no version counters, so no cached keys): the reference's scores."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Toggle(LogitsProcessor):
        def __call__(self, input_ids, scores):
            model.train(not model.training)
            return scores

    model = make_model(3)
    ids = ids_of((2, 3))
    scores = {}
    for backend in ("torch", "reference"):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        model.eval()
        scores[backend] = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                         logits_processor=LogitsProcessorList([Toggle()]), output_scores=True,
                                         return_dict_in_generate=True).scores
    for got, want in zip(scores["torch"], scores["reference"]):
        assert_close(got, want)
    with torch.inference_mode():
        frozen = make_model(3)
        ids = ids_of((1, 1))
        assert_close(logits_on(frozen, ids, "torch", monkeypatch), logits_on(frozen, ids, "reference", monkeypatch))


@pytest.mark.parametrize("path", ["buffer", "rows"])
def test_float32_calls_in_a_float64_model(path, monkeypatch):
    """float32 pseudo-queries and key-norm weights in a float64 model: the op computes in float64, the keys
    ``w * g`` included (exact in float64, rounded in float32: ~1e-8 in the weights before the fix). The first
    call's weights depend only on computations both backends share, so they agree to float64 rounding."""
    model = make_model(3)
    for layer in model.model.layers:
        layer.mlp_res.float()
        layer.output_res.float()
    if path == "rows":
        set_small_numel(monkeypatch, -1)
    ids = ids_of((2, 3))
    first = {}
    for backend in ("torch", "reference"):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        with torch.set_grad_enabled(path == "rows"):
            first[backend] = model.model(ids, use_cache=False, output_depth_weights=True).depth_weights[0].detach()
    assert first["torch"].dtype == first["reference"].dtype == torch.float64
    assert (first["torch"] - first["reference"]).abs().max() <= 64 * torch.finfo(torch.float64).eps


def test_rows_path_under_cpu_autocast(monkeypatch):
    """Training under CPU autocast (bf16 sub-layer outputs, float32 embedding and parameters) on the rows path.

    The rows path rounds a bf16 source's gradient in pieces (the rows' product, the norm, each call's
    ``alpha dh``) where the reference rounds it once per call, so the two differ by bf16 roundings (measured:
    gradients up to 5.3 eps_bf16 apart in norm); but both are that far from the float64 model
    (measured worst 11.7 eps_bf16 for the reference, 11.3 for the rows path). Gates: loss to 16 eps_bf16,
    gradients to the reference 32 eps_bf16 in norm, and the rows path's worst distance to the float64 model's
    gradients at most twice the reference's (it is not less accurate)."""
    set_small_numel(monkeypatch, -1)
    ids = ids_of((2, 6))

    def loss_and_grads(model, autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model.model(ids, use_cache=False, output_depth_weights=True)
            logits = model.lm_head(out.last_hidden_state).float()
            loss = logits.logsumexp(-1).mean() - logits[..., 3].mean() + out.depth_weights[0][..., 0].mean()
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}

    model = make_model(3, torch.float32)
    results = {}
    for backend in ("torch", "reference"):
        monkeypatch.setenv("DEPTHFUSION_BACKEND", backend)
        results[backend] = loss_and_grads(model, True)
    _, truth = loss_and_grads(make_model(3, torch.float64), False)
    eps = torch.finfo(torch.bfloat16).eps
    (loss, grads), (ref_loss, ref_grads) = results["torch"], results["reference"]
    assert abs(loss - ref_loss) <= 16 * eps * abs(ref_loss)
    for name, g in ref_grads.items():
        assert (grads[name] - g).norm() <= 32 * eps * g.norm(), name

    def worst(got):
        return max(((got[n] - t).norm() / t.norm()).item() for n, t in truth.items())

    assert worst(grads) <= 2 * worst(ref_grads)
