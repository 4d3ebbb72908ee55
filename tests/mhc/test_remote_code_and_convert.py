"""Remote-code export (fresh process, no depthfusion_hf, no Triton, offline) and Llama upcycling (llama_to_mhc: the
converted model computes the Llama's logits, to the bound its docstring states)."""

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama import modeling_llama

from depthfusion_hf.convert import llama_to_mhc
from depthfusion_hf.export import save_remote_code_folder
from depthfusion_hf.models.modeling_mhc import MHCForCausalLM
from tests.fresh_process import run_fresh

from .helpers import randomise_mhc, tiny_config, tiny_llama_config


def test_remote_code_loads_in_fresh_process(tmp_path):
    model = randomise_mhc(MHCForCausalLM(tiny_config())).eval()
    folder = save_remote_code_folder(model, tmp_path / "export")
    for name in ("configuration_mhc.py", "modeling_mhc.py", "mhc_connection.py", "mhc_mix.py", "mhc_inputs.py",
                 "mhc_triton.py", "model.safetensors"):
        assert (folder / name).exists(), name
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        weights = model.hyper_connection_weights(ids)
        generated = model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
        logits = model(ids).logits
    torch.save({"ids": ids, "logits": logits, "comb": weights["comb"], "generated": generated},
               tmp_path / "expected.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_fresh(
        f"""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__name__ == "MHCForCausalLM", type(model)
        assert "depthfusion_hf" not in type(model).__module__
        with torch.no_grad():
            diff = (model(expected["ids"]).logits - expected["logits"]).abs().max().item()
            comb = (model.hyper_connection_weights(expected["ids"])["comb"] - expected["comb"]).abs().max().item()
            generated = model.generate(expected["ids"][:1, :4], max_new_tokens=5, do_sample=False)
        base = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True)
        print("DIFF", diff, comb, torch.equal(generated, expected["generated"]), type(base).__name__,
              model.config.hc_mult, model.model.layers[0].attn_hc.fn.dtype)
        """,
        cwd=str(elsewhere),
        hf_home=str(tmp_path / "hf_home"),
    )
    diff, comb, same_generation, base, hc_mult, fn_dtype = out.split("DIFF")[1].split()
    assert float(diff) <= 1e-6  # memory-mapped (possibly misaligned) weights may change float rounding
    assert float(comb) <= 1e-6
    assert same_generation == "True" and base == "MHCModel" and hc_mult == "4" and fn_dtype == "torch.float32"


def trained_looking_llama(dtype=torch.float32, **overrides) -> LlamaForCausalLM:
    """A tiny Llama whose weights are moved off their init (a larger residual stream, non-unit norm weights)."""
    torch.manual_seed(0)
    llama = LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype).eval()
    with torch.no_grad():
        for p in llama.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return llama


def logit_error(model, llama, ids) -> float:
    """``max |logits - Llama's| / max |Llama's|``."""
    with torch.no_grad():
        want = llama(ids).logits
        return ((model(ids).logits - want).abs().max() / want.abs().max()).item()


@pytest.fixture
def float64_rms_norm(monkeypatch):
    """transformers' LlamaRMSNorm normalises in float32 for every input dtype; this computes it in the input's dtype
    (float64 here), so that what remains of a difference is the conversion's own."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_upcycled_model_is_the_llama_in_exact_arithmetic(n, float64_rms_norm):
    """float64 everywhere (the norms too) and rms_norm_eps -> 0: the converted model's logits are the Llama's to
    float64 rounding, whatever n. What the docstring's bound adds is rounding (below) and the norms' epsilon."""
    llama = trained_looking_llama(torch.float64, rms_norm_eps=1e-12)
    model = llama_to_mhc(llama, hc_mult=n)
    assert logit_error(model, llama, torch.randint(3, 97, (2, 16))) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_upcycled_model_is_within_the_stated_bound_of_the_llama(n, dtype):
    """The bound llama_to_mhc's docstring states: max |Δlogits| <= 2e-6 of the logits' scale, float64 and float32
    (with the usual rms_norm_eps; measured: at most 1.7e-7 in float64, 6e-7 in float32). The float32 rounding inside
    LlamaRMSNorm (it normalises in float32 for a float64 model too) is what remains in float64."""
    llama = trained_looking_llama(dtype)
    model = llama_to_mhc(llama, hc_mult=n)
    assert isinstance(model, MHCForCausalLM) and not model.training
    assert model.model.layers[0].attn_hc.fn.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert logit_error(model, llama, torch.randint(3, 97, (2, 16))) <= 2e-6


def test_upcycled_streams_differ_and_the_new_parameters_get_gradients():
    """post is spread over the streams (they differ after the first sub-layer), so every row of fn gets its own
    gradient: training can tell the streams apart. With post_spread = 0 the streams stay equal."""
    llama = trained_looking_llama()
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


def test_upcycled_weights_are_the_llamas_and_bf16_keeps_fp32_hyper_connections(tmp_path):
    llama = trained_looking_llama(torch.bfloat16, tie_word_embeddings=False)
    model = llama_to_mhc(llama, hc_mult=3)
    ours = model.state_dict()
    for name, tensor in llama.state_dict().items():
        assert torch.equal(ours[name], tensor), name
    hc = [name for name in ours if "_hc." in name or "hc_head." in name]
    assert len(hc) == 3 * 2 * 3 + 3 and all(ours[name].dtype == torch.float32 for name in hc)
    assert all(torch.equal(ours[name], torch.zeros_like(ours[name])) for name in hc if name.endswith("fn"))
    assert model.config.hc_mult == 3 and model.config.dtype == torch.bfloat16
    llama.save_pretrained(tmp_path / "llama")
    from_folder = llama_to_mhc(tmp_path / "llama", hc_mult=3)
    ids = torch.randint(3, 97, (1, 8))
    with torch.no_grad():
        assert torch.equal(from_folder(ids).logits, model(ids).logits)


def test_upcycling_rejects_what_it_cannot_convert():
    with pytest.raises(ValueError, match="expected a LlamaForCausalLM"):
        llama_to_mhc(torch.nn.Linear(2, 2))
    llama = trained_looking_llama()
    with pytest.raises(ValueError, match="`hc_mult` must be an integer >= 1"):
        llama_to_mhc(llama, hc_mult=0)
    with pytest.raises(ValueError, match=r"post_spread must be a number in \[0, 1\)"):
        llama_to_mhc(llama, post_spread=1.0)
    with pytest.raises(ValueError, match=r"hc_eps \(0.3\) must be < 1 / hc_mult"):
        llama_to_mhc(llama, hc_mult=4, hc_eps=0.3)
