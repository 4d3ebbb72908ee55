"""Remote-code export (fresh process, no depthfusion_hf, no Triton, offline) and Llama upcycling."""

import pytest
import torch
from transformers import LlamaForCausalLM

from depthfusion_hf.convert import llama_to_attnres
from depthfusion_hf.export import save_remote_code_folder
from depthfusion_hf.models.modeling_attnres import AttnResForCausalLM
from tests.fresh_process import run_fresh

from .helpers import randomise_attnres, tiny_config, tiny_llama_config


@pytest.mark.parametrize("block_size", [None, 3])
def test_remote_code_loads_in_fresh_process(tmp_path, block_size):
    model = AttnResForCausalLM(tiny_config(attnres_block_size=block_size)).eval()
    randomise_attnres(model)
    folder = save_remote_code_folder(model, tmp_path / "export")
    for name in ("configuration_attnres.py", "modeling_attnres.py", "attnres.py", "model.safetensors"):
        assert (folder / name).exists(), name
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        weights = model.depth_attention_weights(ids)
        generated = model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    torch.save({"ids": ids, "logits": model(ids).logits.detach(), "weights": weights, "generated": generated},
               tmp_path / "expected.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_fresh(
        f"""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__name__ == "AttnResForCausalLM", type(model)
        assert "depthfusion_hf" not in type(model).__module__
        with torch.no_grad():
            diff = (model(expected["ids"]).logits - expected["logits"]).abs().max().item()
            wdiff = (model.depth_attention_weights(expected["ids"]) - expected["weights"]).abs().max().item()
            generated = model.generate(expected["ids"][:1, :4], max_new_tokens=5, do_sample=False)
        base = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True)
        print("DIFF", diff, wdiff, torch.equal(generated, expected["generated"]), type(base).__name__,
              model.config.attnres_block_size)
        """,
        cwd=str(elsewhere),
        hf_home=str(tmp_path / "hf_home"),
    )
    diff, wdiff, same_generation, base, block = out.split("DIFF")[1].split()
    assert float(diff) <= 1e-6  # memory-mapped (possibly misaligned) weights may change float rounding
    assert float(wdiff) <= 1e-6
    assert same_generation == "True"
    assert base == "AttnResModel"
    assert block == str(block_size)


def _logit_shift(model, llama, ids) -> float:
    with torch.no_grad():
        return (model(ids).logits - llama(ids).logits).abs().max().item()


@pytest.mark.parametrize("block_size", [None, 2, 3])
def test_llama_upcycling_is_the_llama_up_to_the_norm_eps(block_size, tmp_path):
    """Uniform averaging is the residual sum / N; the pre-norms undo the scale, so only RMSNorm's eps differs.

    With eps -> 0 the converted model gives the Llama's logits (float rounding); with the usual eps it does not.
    """
    torch.manual_seed(0)
    ids = torch.randint(3, 97, (2, 16))
    exact = LlamaForCausalLM(tiny_llama_config(rms_norm_eps=1e-12)).eval()
    model = llama_to_attnres(exact, attnres_block_size=block_size)
    assert isinstance(model, AttnResForCausalLM) and not model.training
    assert model.config.attnres_block_size == block_size and model.config.rms_norm_eps == 1e-12
    assert _logit_shift(model, exact, ids) <= 1e-5

    usual = LlamaForCausalLM(tiny_llama_config()).eval()  # rms_norm_eps = 1e-6
    shift = _logit_shift(llama_to_attnres(usual, attnres_block_size=block_size), usual, ids)
    assert shift > 1e-4  # not exact: the eps is effectively N_l^2 eps (measured values in docs/ATTNRES.md)
    usual.save_pretrained(tmp_path / "llama")
    from_folder = llama_to_attnres(tmp_path / "llama", attnres_block_size=block_size).eval()
    assert _logit_shift(from_folder, usual, ids) == shift  # the folder path copies the same weights


def test_upcycled_weights_are_the_llamas():
    llama = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=False))
    model = llama_to_attnres(llama, attnres_block_size=4)
    ours = model.state_dict()
    for name, tensor in llama.state_dict().items():
        assert torch.equal(ours[name], tensor), name
    assert all(torch.equal(ours[n], torch.zeros_like(ours[n])) for n in ours if n.endswith(".query"))
    assert model.training  # the Llama was in training mode


def test_upcycling_rejects_non_llama_and_bad_block_size():
    with pytest.raises(ValueError, match="expected a Llama"):
        llama_to_attnres(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"`attnres_block_size` must be an integer in \[1, 8\]"):
        llama_to_attnres(LlamaForCausalLM(tiny_llama_config()), attnres_block_size=9)
