"""``depthfusion_hf.upcycle``: one entry point for the four kinds of source (a model object, a folder, a Hub id, a
folder + ``gguf_file``), keeping the tokenizer (chat template) and generation config, dropping the GGUF load's
``quantization_config`` so the converted model saves; unknown families and options are refused naming the allowed
ones. The GGUF file is a tiny Llama written with the ``gguf`` package (tokenizer and chat template in its metadata),
so the test needs no download."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from depthfusion_hf import upcycle
from depthfusion_hf.convert import llama_to_denseformer
from depthfusion_hf.gguf_source import CACHE_ENV, SOURCE_FILE
from tests.causal_lm_checks import TINY_DECODER

from .test_compare_families import load_script

REPO = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
ROUNDING = 2e-6  # mHC's conversion bound, of max |logit| (convert.llama_to_mhc)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**TINY_DECODER)).eval()
    llama.generation_config = GenerationConfig(eos_token_id=[2, 5], repetition_penalty=1.2)
    return llama


def write_gguf(llama: LlamaForCausalLM, path) -> None:
    """``llama`` as a float32 GGUF file in llama.cpp's layout (q/k rows in its rotary order), with a byte-token
    tokenizer and a chat template."""
    gguf = pytest.importorskip("gguf", reason="writing a GGUF file needs the gguf package (a dev extra)")
    config = llama.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    vocab = config.vocab_size
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(vocab - 3)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([2, 3, 3] + [6] * (vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)

    def rotary_order(weight, heads):  # transformers' GGUF loader undoes this (llama.cpp's convert_hf_to_gguf)
        return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)

    state = {name: tensor.numpy() for name, tensor in llama.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(config.num_hidden_layers):
        for ours, theirs in names.items():
            weight = state[f"model.layers.{i}.{ours}.weight"]
            if theirs in ("attn_q", "attn_k"):
                weight = rotary_order(weight, config.num_attention_heads if theirs == "attn_q"
                                      else config.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{theirs}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hub_cache(llama: LlamaForCausalLM, cache_dir, repo_id: str = "someone/tiny-llama") -> str:
    """``llama`` stored as the Hub cache holds a downloaded repository (``models--someone--tiny-llama``)."""
    revision = "0" * 40
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    llama.save_pretrained(repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return repo_id


def logits(model) -> torch.Tensor:
    ids = torch.arange(24).reshape(2, 12) * 7 % model.config.vocab_size  # [2, 12]
    with torch.no_grad():
        return model(ids).logits


def max_difference(model, llama) -> float:
    return (logits(model) - logits(llama)).abs().max().item()


@pytest.mark.parametrize("kind", ["object", "folder", "hub id"])
def test_upcycle_takes_a_model_a_folder_and_a_hub_id(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llama = tiny_llama()
    load = {}
    if kind == "object":
        source = llama
    elif kind == "folder":
        llama.save_pretrained(tmp_path / "llama")
        source = tmp_path / "llama"
    else:
        source, load = hub_cache(llama, tmp_path / "hub"), {"cache_dir": str(tmp_path / "hub")}
    model = upcycle(source, "denseformer", dwa_dilation=2, dwa_period=2, **load)
    assert type(model).__name__ == "DenseFormerForCausalLM" and model.config.dwa_dilation == 2
    assert max_difference(model, llama) == 0
    assert model.generation_config.eos_token_id == [2, 5] and model.generation_config.repetition_penalty == 1.2
    assert not model.training  # the Llama was in eval mode (from_pretrained: too)


@pytest.fixture
def gguf_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    llama = tiny_llama()
    (tmp_path / "source").mkdir()
    write_gguf(llama, tmp_path / "source" / "tiny.gguf")
    return llama, tmp_path / "source"


def test_a_gguf_file_upcycles_to_a_saveable_model_with_its_tokenizer(gguf_folder, tmp_path):
    llama, folder = gguf_folder
    model = upcycle(folder, "mhc", gguf_file="tiny.gguf", save_to=tmp_path / "out")
    scale = logits(llama).abs().max().item()
    assert max_difference(model, llama) <= ROUNDING * scale  # a float32 GGUF holds the Llama's own weights
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model_type"] == "mhc" and "quantization_config" not in saved
    assert "quantization_config" not in model.config.to_dict()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.chat_template == CHAT_TEMPLATE and len(tokenizer) == llama.config.vocab_size
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert max_difference(loaded, model) == 0
    # the float copy is made once: a second upcycle reads the cached folder
    cached = next((tmp_path / "cache" / "gguf").iterdir())
    assert (cached / SOURCE_FILE).is_file() and "quantization_config" not in (cached / "config.json").read_text()
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    again = upcycle(folder, "denseformer", gguf_file="tiny.gguf")
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp
    assert max_difference(again, llama) == 0


def test_a_gguf_loaded_object_converts_without_its_stale_quantization_config(gguf_folder, tmp_path):
    llama, folder = gguf_folder
    loaded = LlamaForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf")
    assert loaded.config.quantization_config is not None  # transformers keeps it although the weights are float
    model = upcycle(loaded, "attnres")
    assert "quantization_config" not in model.config.to_dict()
    model.save_pretrained(tmp_path / "attnres")  # a GGUF-loaded Llama itself refuses this
    assert "quantization_config" not in (tmp_path / "attnres" / "config.json").read_text()


def test_bad_family_or_option_is_a_value_error_naming_the_allowed_ones():
    llama = tiny_llama()
    with pytest.raises(ValueError, match=r"family must be one of \['denseformer', 'moda', 'attnres', 'mhc'\]; "
                                         r"got 'dwatt'"):
        upcycle(llama, "dwatt")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['dwa_dilation'\] for family 'mhc': its options are "
                                         r"\['hc_mult', .*the loading options are \['gguf_file'"):
        upcycle(llama, "mhc", dwa_dilation=2)
    with pytest.raises(ValueError, match=r"loading options \['revision'\] apply to a folder or Hub id"):
        upcycle(llama, "mhc", revision="main")
    # the per-family converters refuse a misspelt option too (it was ignored for a model object)
    with pytest.raises(ValueError, match=r"unknown loading option\(s\) \['dwa_dilaton'\]"):
        llama_to_denseformer(llama, dwa_dilaton=2)


def test_train_clm_upcycles_a_gguf_file(gguf_folder, tmp_path):
    _, folder = gguf_folder
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")  # the cache folder of the fixture
    out = tmp_path / "run"
    command = [sys.executable, str(REPO / "scripts" / "train_clm.py"), "--init_from", str(folder), "--gguf_file",
               "tiny.gguf", "--model", "mhc", "--max_steps", "1", "--eval_steps", "0", "--batch_size", "2",
               "--block_size", "16", "--max_train_blocks", "4", "--max_eval_blocks", "2", "--no_baseline",
               "--output_dir", str(out)]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = out / "mhc" / "final"
    assert "quantization_config" not in (final / "config.json").read_text()
    assert AutoTokenizer.from_pretrained(final).chat_template == CHAT_TEMPLATE  # the GGUF's own tokenizer
    proc = subprocess.run(command[:2] + ["--gguf_file", "tiny.gguf", "--output_dir", str(tmp_path / "x")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "--gguf_file names a file in the --init_from folder" in proc.stderr


def test_the_upcycle_script_wants_init_from_with_a_gguf_file(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_script("upcycle").parse_args(["--gguf_file", "model.gguf"])
    assert exit_info.value.code == 2
    assert "--gguf_file names a file in the --init_from folder" in capsys.readouterr().err


def test_the_new_parameter_rate_follows_the_moda_conversion():
    """The learning-rate rule for the parameters a Llama lacks: MoDA upcycled with closed depth gates (the default)
    trains them at 1x (docs/RESULTS.md, SmolLM2, 3 seeds), the ungated conversion at 10x, as DenseFormer."""
    from depthfusion_hf.recipes.clm import recommended_new_param_lr_scale

    gated, ungated = upcycle(tiny_llama(), "moda"), upcycle(tiny_llama(), "moda", depth_gate=False)
    assert gated.config.moda_depth_gate and not ungated.config.moda_depth_gate
    assert recommended_new_param_lr_scale("moda", gated.config) == 1.0
    assert recommended_new_param_lr_scale("moda", ungated.config) == recommended_new_param_lr_scale("moda") == 10.0
    dense = upcycle(tiny_llama(), "denseformer")
    assert recommended_new_param_lr_scale("denseformer", dense.config) == 10.0
