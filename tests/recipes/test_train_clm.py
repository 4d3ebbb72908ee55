"""The causal-LM main job end to end on the built-in corpus (tiny model, a few steps): ``scripts/train_clm.py`` run as
a user runs it, in a new interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from depthfusion_hf.data.corpus import load_documents, pack_into_blocks, split_documents, train_bpe_tokenizer
from depthfusion_hf.safe_folder import load_marker

REPO = Path(__file__).resolve().parents[2]
TINY = ["--config", str(REPO / "configs" / "clm_tiny.json"), "--max_steps", "8", "--eval_steps", "4",
        "--batch_size", "4", "--max_train_blocks", "64", "--max_eval_blocks", "8", "--vocab_size", "400"]


def train_clm(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python scripts/train_clm.py ARGS`` (offline, one thread)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "train_clm.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def test_builtin_corpus_is_real_english():
    docs = load_documents()
    assert len(docs) == 1189  # chapters of the King James Bible
    assert docs[0].startswith("In the beginning God created the heaven and the earth.")
    train, val = split_documents(docs, 0.03)
    assert len(val) == 36 and train[-1] != val[0]


def test_tokenizer_and_packing_round_trip():
    docs = load_documents()[:50]
    tokenizer = train_bpe_tokenizer(docs, vocab_size=300)
    assert len(tokenizer) == 300
    blocks = pack_into_blocks(tokenizer, docs[:5], block_size=32)
    ids = [i for b in blocks["input_ids"] for i in b]
    assert all(len(b) == 32 for b in blocks["input_ids"])
    assert tokenizer.decode(ids[:20]) == tokenizer.decode(tokenizer(docs[0])["input_ids"][:20])


def test_local_files_and_bad_inputs(tmp_path):
    (tmp_path / "a.txt").write_text("First paragraph here.\n\nSecond one.\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    assert load_documents(files=[tmp_path / "a.txt"]) == ["First paragraph here.", "Second one."]
    with pytest.raises(ValueError, match="record 2 has no 'text' field"):
        load_documents(files=[tmp_path / "b.jsonl"])
    with pytest.raises(ValueError, match="unsupported data file type '.csv'"):
        (tmp_path / "c.csv").write_text("x")
        load_documents(files=[tmp_path / "c.csv"])
    with pytest.raises(ValueError, match="validation_fraction must be in"):
        split_documents(["a", "b"], 1.5)


def test_main_job_trains_both_models_and_writes_everything(tmp_path):
    out = tmp_path / "run"
    proc = train_clm(TINY + ["--dwa_dilation", "2", "--dwa_period", "2", "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    names = [r["name"] for r in results["runs"]]
    assert names == ["denseformer 2x2", "llama (baseline)"]
    assert [r["model_type"] for r in results["runs"]] == ["denseformer", "llama"]  # what clm_results reads
    for run in results["runs"]:
        assert 0 < run["eval_loss"] < 7 and run["tokens_per_second"] > 0
    dense, llama = results["runs"]
    assert dense["parameters"] - llama["parameters"] == 2 + 3  # DWA after blocks 2 and 4 with dilation 2
    assert (out / "dwa_weights.png").stat().st_size > 1000
    assert f"DenseFormer analysis plot: {out / 'dwa_weights.png'}" in proc.stdout
    assert "| denseformer 2x2 |" in (out / "results.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(out / "denseformer" / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "denseformer" / "final")
    assert model.config.dwa_dilation == 2 and len(tokenizer) == 400
    assert not torch.equal(model.model.dwa.alphas, model.model.dwa.identity_alphas())  # the DWA weights trained
    for kind in ("denseformer", "llama"):  # both final folders are marked exports, so a rerun may replace them
        assert "model.safetensors" in load_marker(out / kind / "final").files


def test_moda_run_draws_its_depth_share_plot(tmp_path):
    out = tmp_path / "run"
    proc = train_clm(TINY + ["--model", "moda", "--max_steps", "2", "--eval_steps", "0", "--no_baseline",
                             "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert (run["name"], run["model_type"]) == ("moda", "moda")
    assert (out / "moda_depth_share.png").stat().st_size > 1000 and not (out / "dwa_weights.png").exists()


def test_bad_arguments_and_foreign_final_folders_are_rejected_before_training(tmp_path):
    proc = train_clm(["--max_steps", "0", "--output_dir", str(tmp_path / "a")], tmp_path)
    assert proc.returncode == 2 and "argument --max_steps: must be an integer >= 1; got 0" in proc.stderr
    proc = train_clm(TINY + ["--dwa_dilation", "9", "--output_dir", str(tmp_path / "b")], tmp_path)
    assert proc.returncode == 1 and "`dwa_dilation` must be an integer in" in proc.stderr
    final = tmp_path / "c" / "llama" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")  # e.g. saved by hand, not by this package
    proc = train_clm(TINY + ["--output_dir", str(tmp_path / "c")], tmp_path)
    assert proc.returncode == 1 and "is not an export of this package" in proc.stderr and "config.json" in proc.stderr
    assert "data:" not in proc.stdout  # refused before the data work and the training
    assert (final / "config.json").read_text() == "{}"



def test_overwrite_writes_final_folders_beside_foreign_entries(tmp_path):
    """--overwrite: a final folder holding the user's notes is written into, the notes kept; without it the run
    stops before training (the error names the option)."""
    out = tmp_path / "run"
    final = out / "denseformer" / "final"
    final.mkdir(parents=True)
    (final / "notes.txt").write_text("mine")
    args = TINY + ["--max_steps", "2", "--eval_steps", "0", "--no_baseline", "--output_dir", str(out)]
    proc = train_clm(args, tmp_path)
    assert proc.returncode == 1 and "notes.txt" in proc.stderr and "--overwrite" in proc.stderr
    proc = train_clm(args + ["--overwrite"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (final / "notes.txt").read_text() == "mine" and (final / "config.json").is_file()

def test_trainer_does_not_decay_dwa_weights(tmp_path):
    from transformers import TrainingArguments

    from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM
    from depthfusion_hf.recipes.clm import DepthFusionTrainer

    model = DenseFormerForCausalLM(DenseFormerConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                                     num_hidden_layers=2, num_attention_heads=2))
    trainer = DepthFusionTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to="none",
                                                                    use_cpu=True))
    decayed = set(trainer.get_decay_parameter_names(model))
    assert "model.dwa.alphas" not in decayed
    assert "model.layers.0.mlp.up_proj.weight" in decayed and "model.embed_tokens.weight" in decayed
    assert not any("norm" in n for n in decayed)


def tiny_llama_folder(folder: Path, vocab_size: int = 400, tokenizer: bool = True, chat_template: str | None = None,
                      model_type: str = "llama"):
    """A random 2-layer Llama (or another backbone's causal LM, ``model_type``) saved with (by default) its own BPE
    tokenizer of ``vocab_size`` tokens; returns the model and the tokenizer (or ``None``)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    tok = train_bpe_tokenizer(load_documents()[:40], vocab_size=vocab_size) if tokenizer else None
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id) if tok \
        else {}
    llama = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, head_dim=16, **special))
    llama.generation_config = GenerationConfig(**special, repetition_penalty=1.3)
    llama.save_pretrained(folder)
    if tok is not None:
        if chat_template is not None:
            tok.chat_template = chat_template
        tok.save_pretrained(folder)
    return llama, tok


def test_upcycling_run_trains_the_new_parameters_at_their_own_rate(tmp_path):
    llama, _ = tiny_llama_folder(tmp_path / "llama")
    out = tmp_path / "run"
    # lr 1e-7 for the Llama's weights, 1e-7 x 1e5 = 1e-2 for the DWA weights: Adam moves each parameter by about
    # its rate per step, so after 4 steps the pretrained weights are unchanged to ~1e-6 and the DWA weights are not.
    proc = train_clm(TINY + ["--init_from", str(tmp_path / "llama"), "--max_steps", "4", "--eval_steps", "0",
                             "--learning_rate", "1e-7", "--new_param_lr_scale", "1e5", "--warmup_ratio", "0",
                             "--weight_decay", "0", "--no_baseline", "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out / "denseformer" / "final")
    alphas_moved = (model.model.dwa.alphas - model.model.dwa.identity_alphas()).abs().max().item()
    trained, start = model.state_dict(), llama.state_dict()
    llama_moved = max((trained[name] - start[name]).abs().max().item() for name in start if name in trained)
    assert alphas_moved > 1e-3 and llama_moved < 1e-5, (alphas_moved, llama_moved)
    proc = train_clm(TINY + ["--new_param_lr_scale", "10", "--output_dir", str(tmp_path / "x")], tmp_path)
    assert proc.returncode == 2 and "--new_param_lr_scale applies to upcycling" in proc.stderr


def test_upcycling_another_backbone_trains_the_family_and_the_source_side_by_side(tmp_path):
    """--init_from a Qwen3 folder (issue 30): the family is built on the Qwen3 backbone, the baseline is the Qwen3."""
    qwen3, _ = tiny_llama_folder(tmp_path / "qwen3", model_type="qwen3")
    out = tmp_path / "run"
    proc = train_clm(TINY + ["--init_from", str(tmp_path / "qwen3"), "--model", "attnres", "--max_steps", "1",
                             "--eval_steps", "0", "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    family = AutoModelForCausalLM.from_pretrained(out / "attnres" / "final")
    assert family.config.backbone_config.model_type == "qwen3"
    assert family.model.layers[0].self_attn.q_norm.weight.shape == qwen3.model.layers[0].self_attn.q_norm.weight.shape
    baseline = [path for path in out.iterdir() if path.is_dir() and path.name != "attnres"]
    assert [AutoModelForCausalLM.from_pretrained(path / "final").config.model_type for path in baseline] == ["qwen3"]


def test_a_config_with_a_backbone_trains_the_family_and_that_backbone_side_by_side(tmp_path):
    """--config with a ``backbone_config`` (issue 30): the family is built on that decoder, and the same-seed baseline
    is the backbone's own causal LM at the same sizes (before, a default-size Llama of 6.7B parameters)."""
    from tests.training.launch import tiny_config

    config = tiny_config("gemma3_text", tmp_path)  # configs/clm_tiny.json's sizes as a Gemma 3 backbone_config
    out = tmp_path / "run"
    proc = train_clm(TINY + ["--config", str(config), "--model", "mhc", "--max_steps", "1", "--eval_steps", "0",
                             "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    family = AutoModelForCausalLM.from_pretrained(out / "mhc" / "final")
    baseline = AutoModelForCausalLM.from_pretrained(out / "llama" / "final")
    assert family.config.backbone_config.model_type == baseline.config.model_type == "gemma3_text"
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "layer_types", "sliding_window", "tie_word_embeddings")
    for field in shape:
        assert getattr(family.config.backbone_config, field) == getattr(baseline.config, field), field
    assert "| gemma3_text (baseline) |" in proc.stdout


def test_upcycling_trains_with_the_llamas_own_tokenizer_and_keeps_what_it_holds(tmp_path):
    """Before, ``--init_from`` trained a fresh BPE (the pretrained embeddings then read scrambled ids)."""
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    _, own = tiny_llama_folder(tmp_path / "llama", vocab_size=420, chat_template=template)
    out = tmp_path / "run"
    # --vocab_size 400 would give a fresh BPE another vocabulary than the Llama's own 420 tokens
    proc = train_clm(TINY + ["--init_from", str(tmp_path / "llama"), "--max_steps", "1", "--eval_steps", "0",
                             "--no_baseline", "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = out / "denseformer" / "final"
    saved = AutoTokenizer.from_pretrained(final)
    assert saved.get_vocab() == own.get_vocab() and saved.chat_template == template
    assert (saved.bos_token, saved.eos_token, saved.pad_token) == (own.bos_token, own.eos_token, own.pad_token)
    generation = json.loads((final / "generation_config.json").read_text())
    assert generation["repetition_penalty"] == 1.3 and generation["eos_token_id"] == own.eos_token_id


def test_upcycling_refuses_a_tokenizer_that_does_not_fit_the_llama(tmp_path):
    tiny_llama_folder(tmp_path / "llama", vocab_size=420)
    other = train_bpe_tokenizer(load_documents()[50:90], vocab_size=420)  # same size, other vocabulary
    other.save_pretrained(tmp_path / "other")
    proc = train_clm(TINY + ["--init_from", str(tmp_path / "llama"), "--tokenizer", str(tmp_path / "other"),
                             "--max_steps", "1", "--no_baseline", "--output_dir", str(tmp_path / "a")], tmp_path)
    assert proc.returncode == 1 and "has another vocabulary" in proc.stderr and "the Llama" in proc.stderr
    tiny_llama_folder(tmp_path / "bare", vocab_size=300, tokenizer=False)  # a Llama folder without a tokenizer
    proc = train_clm(TINY + ["--init_from", str(tmp_path / "bare"), "--max_steps", "1", "--no_baseline",
                             "--output_dir", str(tmp_path / "b")], tmp_path)
    assert proc.returncode == 1 and "holds no tokenizer" in proc.stderr and "pass --tokenizer" in proc.stderr
    proc = train_clm(TINY + ["--init_from", str(tmp_path / "bare"), "--tokenizer", str(tmp_path / "other"),
                             "--max_steps", "1", "--no_baseline", "--output_dir", str(tmp_path / "c")], tmp_path)
    assert proc.returncode == 1 and "the tokenizer has 420 tokens, more than the model's vocab_size 300" in proc.stderr
    assert not any((tmp_path / name / "denseformer" / "final").exists() for name in "abc")
