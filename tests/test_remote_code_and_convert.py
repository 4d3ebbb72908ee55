"""Remote-code export of every causal family (a fresh process without depthfusion_hf or Triton, offline, loads it
and computes the same numbers) and the Llama conversion (``Family.from_llama``: the Llama's logits to the bound
of the family's entry in ``tests/family_cases.py``), then the few conversion details one family has."""

import json

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama import modeling_llama

from depthfusion_hf.convert import llama_to_attnres, llama_to_mhc, llama_to_moda
from depthfusion_hf.export import save_remote_code_folder
from depthfusion_hf.families import causal_lm_families, get_family
from tests.family_cases import CASES, params, tiny_model
from tests.fresh_process import run_fresh

FAMILIES = causal_lm_families()


@pytest.mark.parametrize(("family", "overrides"), params("remote_code"))
def test_remote_code_loads_in_fresh_process(tmp_path, family, overrides):
    """Two folders: the package's export (``save_remote_code_folder``, with the ``AutoModel`` entry) and transformers'
    own ``register_for_auto_class`` + ``save_pretrained``. Both load with ``trust_remote_code`` elsewhere and give
    the logits, greedy tokens, analysis weights, config fields and parameter dtypes of the saved model."""
    entry, case = get_family(family), CASES[family]
    model = tiny_model(family, **overrides)
    folder = save_remote_code_folder(model, tmp_path / "export")
    for name in (f"configuration_{family}.py", f"modeling_{family}.py", *case.op_files, "model.safetensors"):
        assert (folder / name).exists(), name
    type(model.config).register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    model.save_pretrained(tmp_path / "plain")
    ids = torch.randint(3, 97, (2, 9))
    analysis = case.analysis or "None"
    with torch.no_grad():
        expected = {"ids": ids, "logits": model(ids).logits, "analysis": eval(analysis, {"model": model, "ids": ids}),
                    "generated": model.generate(ids[:, :4], max_new_tokens=5, do_sample=False, pad_token_id=0,
                                                eos_token_id=None)}
    torch.save(expected, tmp_path / "expected.pt")
    facts = {"dtypes": {name: str(p.dtype) for name, p in model.named_parameters()},
             "fields": {name: getattr(model.config, name) for name in overrides}}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_fresh(
        f"""
        import json, torch
        from transformers import AutoModel, AutoModelForCausalLM
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        ids = expected["ids"]
        report = {{}}
        for name in ("export", "plain"):
            model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r} + "/" + name, trust_remote_code=True).eval()
            assert "depthfusion_hf" not in type(model).__module__
            with torch.no_grad():
                analysis = {analysis}
                generated = model.generate(ids[:, :4], max_new_tokens=5, do_sample=False, pad_token_id=0,
                                           eos_token_id=None)
                report[name] = dict(
                    type=type(model).__name__,
                    diff=(model(ids).logits - expected["logits"]).abs().max().item(),
                    analysis=None if analysis is None else (analysis - expected["analysis"]).abs().max().item(),
                    same_generation=torch.equal(generated, expected["generated"]),
                    dtypes={{n: str(p.dtype) for n, p in model.named_parameters()}},
                    fields={{n: getattr(model.config, n) for n in {sorted(overrides)!r}}})
        report["base"] = type(AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True)).__name__
        print("REPORT", json.dumps(report))
        """,
        cwd=str(elsewhere),
        hf_home=str(tmp_path / "hf_home"),
    )
    report = json.loads(out.split("REPORT", 1)[1])
    assert report["base"] == entry.base_model_class.__name__
    for name in ("export", "plain"):
        loaded = report[name]
        assert loaded["type"] == entry.task_model_class.__name__, (name, loaded)
        assert loaded["diff"] <= 1e-6, (name, loaded)  # memory-mapped (possibly misaligned) weights may round otherwise
        assert case.analysis is None or loaded["analysis"] <= 1e-6, (name, loaded)
        assert loaded["same_generation"], (name, loaded)
        assert loaded["dtypes"] == facts["dtypes"] and loaded["fields"] == facts["fields"], (name, loaded)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_is_atomic(tmp_path, monkeypatch, family):
    """A save that fails half-way leaves the earlier export as it was and no staging folder behind."""
    model = tiny_model(family)
    folder = save_remote_code_folder(model, tmp_path / "export")
    before = sorted(p.name for p in folder.iterdir())

    def broken_save(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        save_remote_code_folder(model, folder)
    assert sorted(p.name for p in folder.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def tiny_llama(family: str, dtype: torch.dtype = torch.float32, noise: float = 0.0, **overrides) -> LlamaForCausalLM:
    """The Llama of the family's tiny shape in eval mode, its weights moved by ``noise`` (std) off their init."""
    torch.manual_seed(0)
    llama = LlamaForCausalLM(CASES[family].tiny_llama_config(**overrides)).to(dtype).eval()
    with torch.no_grad():
        for p in llama.parameters():
            p.add_(noise * torch.randn_like(p))
    return llama


@pytest.mark.parametrize(("family", "name"), [pytest.param(f, n, id=f"{f}-{n}") for f in FAMILIES
                                              for n in CASES[f].conversions])
def test_conversion_gives_the_llamas_logits(family, name, tmp_path):
    """The converted model (from the Llama object and from its folder) gives the Llama's logits to the entry's
    bound; the folder path copies the same weights (equal logits)."""
    conversion = CASES[family].conversions[name]
    llama = tiny_llama(family, conversion.dtype, conversion.llama_noise, **conversion.llama)
    convert = get_family(family).from_llama
    model = convert(llama, **conversion.kwargs)
    assert isinstance(model, get_family(family).task_model_class) and not model.training
    assert {p.dtype for p in model.parameters()} == {conversion.dtype}  # the new parameters too
    for field, value in {**conversion.kwargs, **conversion.llama}.items():
        field = {"depth_gate": "moda_depth_gate"}.get(field, field)  # the converter's name for a config field
        assert getattr(model.config, field) == value, field
    ids = torch.randint(3, 97, (2, 16))
    with torch.no_grad():
        want, got = llama(ids).logits, model(ids).logits
        assert (got - want).abs().max() <= conversion.atol + conversion.rtol * want.abs().max()
        llama.save_pretrained(tmp_path / "llama")
        assert torch.equal(convert(tmp_path / "llama", **conversion.kwargs).eval()(ids).logits, got)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_holds_the_llamas_weights(family):
    """Every Llama tensor is copied (untied embeddings), and the training mode is kept."""
    llama = tiny_llama(family, tie_word_embeddings=False).train()
    model = get_family(family).from_llama(llama, **next(iter(CASES[family].conversions.values())).kwargs)
    ours = model.state_dict()
    for name, tensor in llama.state_dict().items():
        assert torch.equal(ours[name], tensor), name
    assert model.training


@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_rejects_what_it_cannot_convert(family):
    convert = get_family(family).from_llama
    with pytest.raises(ValueError, match="expected the causal LM of a supported backbone"):
        convert(torch.nn.Linear(2, 2))
    llama = tiny_llama(family)
    for kwargs, message in CASES[family].conversion_rejects:
        with pytest.raises(ValueError, match=message):
            convert(llama, **kwargs)


# ---------------------------------------------------------------------------------------------------
# One family's conversion details
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [None, 2, 3])
def test_attnres_conversion_differs_from_the_llama_by_the_norm_eps_only(block_size):
    """With the usual rms_norm_eps the converted AttnRes is not the Llama: the eps is effectively N_l^2 eps (measured
    values in docs/ATTNRES.md); its pseudo-queries start at zero (uniform averaging)."""
    llama = tiny_llama("attnres")  # rms_norm_eps = 1e-6
    model = llama_to_attnres(llama, attnres_block_size=block_size)
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters() if n.endswith(".query"))
    ids = torch.randint(3, 97, (2, 16))
    with torch.no_grad():
        assert (model(ids).logits - llama(ids).logits).abs().max() > 1e-4


@pytest.fixture
def float64_rms_norm(monkeypatch):
    """transformers' LlamaRMSNorm normalises in float32 for every input dtype; this computes it in the input's dtype
    (float64 here), so that what remains of a difference is the conversion's own."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_mhc_conversion_is_the_llama_in_exact_arithmetic(n, float64_rms_norm):
    """float64 everywhere (the norms too) and rms_norm_eps -> 0: the converted model's logits are the Llama's to
    float64 rounding, whatever n (its fp64 hyper-connection parameters included). What the docstring's bound adds
    is rounding and the norms' epsilon."""
    llama = tiny_llama("mhc", torch.float64, 0.05, rms_norm_eps=1e-12)
    model = llama_to_mhc(llama, hc_mult=n)
    assert model.model.layers[0].attn_hc.fn.dtype == torch.float64
    ids = torch.randint(3, 97, (2, 16))
    with torch.no_grad():
        want = llama(ids).logits
        assert ((model(ids).logits - want).abs().max() / want.abs().max()).item() <= 1e-12


def test_mhc_converted_streams_differ_and_the_new_parameters_get_gradients():
    """post is spread over the streams (they differ after the first sub-layer), so every row of fn gets its own
    gradient: training can tell the streams apart. With post_spread = 0 the streams stay equal."""
    llama = tiny_llama("mhc", noise=0.05)
    ids = torch.randint(3, 97, (2, 10))
    model = llama_to_mhc(llama, hc_mult=4).train()
    out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    streams = out.hidden_states[1]
    assert (streams[:, :, 0] - streams[:, :, 3]).abs().max() > 1e-3
    out.loss.backward()
    grad = model.model.layers[1].attn_hc.fn.grad
    assert grad.abs().max() > 0 and not torch.allclose(grad[0], grad[1])
    equal = llama_to_mhc(llama, hc_mult=4, post_spread=0.0).eval()
    streams = equal(input_ids=ids, output_hidden_states=True).hidden_states[2]
    assert torch.equal(streams[:, :, 0], streams[:, :, 3])


def test_mhc_conversion_of_a_bf16_llama_keeps_fp32_hyper_connections(tmp_path):
    llama = tiny_llama("mhc", torch.bfloat16, 0.05, tie_word_embeddings=False)
    model = llama_to_mhc(llama, hc_mult=3)
    ours = model.state_dict()
    for name, tensor in llama.state_dict().items():
        assert torch.equal(ours[name], tensor), name
    hc = [name for name in ours if "_hc." in name or "hc_head." in name]
    assert len(hc) == 3 * 2 * 3 + 3 and all(ours[name].dtype == torch.float32 for name in hc)
    assert all(torch.equal(ours[name], torch.zeros_like(ours[name])) for name in hc if name.endswith("fn"))
    assert model.config.hc_mult == 3 and model.config.dtype == torch.bfloat16
    llama.save_pretrained(tmp_path / "llama")
    ids = torch.randint(3, 97, (1, 8))
    with torch.no_grad():
        assert torch.equal(llama_to_mhc(tmp_path / "llama", hc_mult=3)(ids).logits, model(ids).logits)


@pytest.mark.parametrize("rule", ["zero", "zero_value", "copy_kv"])
def test_moda_conversion_ffn_kv_rules(rule):
    """The FFN-side depth K/V projection starts from the attention's K and V by the rule; the depth entries then
    join the softmax: with closed depth gates (the default) the model is the Llama, ungated it is not."""
    llama = tiny_llama("moda")
    moda = llama_to_moda(llama, ffn_kv_init=rule)
    ours = moda.state_dict()
    for name, tensor in llama.state_dict().items():
        assert torch.equal(ours[name], tensor), name
    config = CASES["moda"].tiny_config()
    head_dim, kv_heads = config.hidden_size // config.num_attention_heads, config.num_key_value_heads
    weight = moda.model.layers[1].ffn_kv_proj.weight.view(kv_heads, 2, head_dim, config.hidden_size)
    attn = moda.model.layers[1].self_attn
    zeros = torch.zeros(kv_heads, head_dim, config.hidden_size)
    key = attn.k_proj.weight.view_as(zeros) if rule != "zero" else zeros
    value = attn.v_proj.weight.view_as(zeros) if rule == "copy_kv" else zeros
    assert torch.equal(weight[:, 0], key) and torch.equal(weight[:, 1], value)
    ids = torch.randint(3, 97, (2, 10))
    ungated = llama_to_moda(llama, ffn_kv_init=rule, depth_gate=False)
    with torch.no_grad():
        logits, ungated_logits, want = moda(ids).logits, ungated(ids).logits, llama(ids).logits
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)  # closed gates: the Llama
    assert torch.isfinite(ungated_logits).all()
    assert (ungated_logits - want).abs().max() > 1e-2  # the paper's MoDA: depth entries join the softmax at once
