"""AttnRes in the package: registry entry, Auto classes, configs, the main job (train_clm), the Hub export with
its model card (usage code run as written), and the depth-attention heatmap."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard, metadata_load
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaConfig

from depthfusion_hf import FAMILIES
from depthfusion_hf.export import check_export_folder, default_model_cards_dir, export_model
from depthfusion_hf.models.configuration_attnres import AttnResConfig
from depthfusion_hf.models.modeling_attnres import AttnResForCausalLM, AttnResModel
from depthfusion_hf.plotting_attnres import depth_attention_labels, plot_depth_attention_heatmap
from tests.export.builders import bpe_tokenizer

from .helpers import randomise_attnres, tiny_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def test_auto_classes_registered():
    fields = tiny_config(attnres_block_size=2).to_dict()
    fields.pop("model_type")
    config = AutoConfig.for_model("attnres", **fields)
    assert isinstance(config, AttnResConfig) and config.attnres_block_size == 2
    assert isinstance(AutoModel.from_config(config), AttnResModel)
    assert isinstance(AutoModelForCausalLM.from_config(config), AttnResForCausalLM)
    family = FAMILIES["attnres"]
    assert family.is_causal_lm and family.pipeline_tag == "text-generation"
    assert family.variant_name(config) == "attnres block 2"
    assert family.variant_name(tiny_config()) == "attnres full"


def _config_file(name: str) -> AttnResConfig:
    fields = {k: v for k, v in json.loads((CONFIGS / name).read_text()).items() if not k.startswith("_")}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def test_tiny_config_runs():
    config = _config_file("attnres_tiny.json")
    assert (config.num_hidden_layers, config.attnres_block_size, config.num_blocks) == (6, 4, 3)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        assert model(torch.randint(3, 97, (1, 7))).logits.shape == (1, 7, 97)


def test_paper_scale_config_is_eight_blocks_and_adds_two_vectors_per_call():
    config = _config_file("attnres_paper_24l_block8.json")
    assert config.num_sublayers == 48 and config.num_blocks == 8
    with torch.device("meta"):
        model = AttnResForCausalLM(config)
        llama_fields = {k: v for k, v in config.to_dict().items() if k in LlamaConfig.__dataclass_fields__}
        llama_fields.pop("model_type", None)
        llama = AutoModelForCausalLM.from_config(LlamaConfig(**llama_fields))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(model) - count(llama) == 2 * 48 * 2048
    assert 1.1e9 < count(model) < 1.3e9


def test_cli_option_parses_full_and_block_sizes():
    sys.path.insert(0, str(REPO / "scripts"))
    import train_clm

    # not given: no value from the command line, so the --config file or the config default (full AttnRes) decides
    args = train_clm.parse_args(["--model", "attnres"])
    assert FAMILIES["attnres"].config_kwargs(args) == {}
    assert AttnResConfig(**FAMILIES["attnres"].config_kwargs(args)).attnres_block_size is None
    assert train_clm.parse_args(["--model", "attnres", "--attnres_block_size", "full"]).attnres_block_size is None
    assert train_clm.parse_args(["--model", "attnres", "--attnres_block_size", "4"]).attnres_block_size == 4
    with pytest.raises(SystemExit):
        train_clm.parse_args(["--model", "attnres", "--attnres_block_size", "four"])


@pytest.mark.integration
def test_main_job_trains_attnres_and_draws_the_heatmap(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    import train_clm

    out = tmp_path / "run"
    results = train_clm.main([
        "--model", "attnres", "--attnres_block_size", "2", "--no_baseline",
        "--config", str(CONFIGS / "clm_tiny.json"), "--max_steps", "6", "--eval_steps", "3",
        "--batch_size", "4", "--max_train_blocks", "48", "--max_eval_blocks", "8", "--vocab_size", "400",
        "--output_dir", str(out),
    ])
    (run,) = results["runs"]
    assert run["name"] == "attnres block 2" and run["model_type"] == "attnres"
    assert 0 < run["eval_loss"] < 7
    assert (out / "attnres_depth_weights.png").stat().st_size > 1000
    model = AutoModelForCausalLM.from_pretrained(out / "attnres" / "final")
    assert isinstance(model, AttnResForCausalLM) and model.config.attnres_block_size == 2
    assert model.model.layers[0].output_res.query.abs().max() > 0  # the pseudo-queries trained


def test_card_template_has_valid_metadata_citation_and_limitations():
    path = default_model_cards_dir() / "attnres.md"
    meta = metadata_load(path)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"custom_code", "attnres"} <= set(meta["tags"]) and meta["license"] == "apache-2.0"
    text = path.read_text()
    assert ModelCard(text).data.library_name == "transformers"
    assert "## Limitations" in text and "## Usage" in text
    (bibtex,) = re.findall(r"```bibtex\n(.*?)```", text, re.DOTALL)
    assert "2603.15031" in bibtex and bibtex.count("{") == bibtex.count("}")
    blocks = PYTHON_BLOCK.findall(text)
    assert len(blocks) >= 3 and all("{{ repo_id }}" in block for block in blocks)


@pytest.mark.integration
def test_export_folder_is_complete_and_card_code_runs_as_written(tmp_path):
    tokenizer = bpe_tokenizer()
    torch.manual_seed(0)
    model = AttnResForCausalLM(AttnResConfig(
        vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, attnres_block_size=4)).eval()
    randomise_attnres(model)
    folder = export_model(model, tmp_path / "attnres", tokenizer=tokenizer, repo_id="me/attnres-tiny")
    assert check_export_folder(folder, tokenizer=True, model_card=True) == []
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_attnres.AttnResForCausalLM"
    assert auto_map["AutoModel"] == "modeling_attnres.AttnResModel"
    card = (folder / "README.md").read_text()
    assert re.search(r"\{\{\s*\w+\s*\}\}", card) is None
    assert "block AttnRes, 2 blocks of 4 sub-layers" in card and "over\n3 sources" in card
    assert f"{2 * 6 * 48:,} numbers" in card and "shape [7, 3]" in card

    blocks = [b.replace("me/attnres-tiny", str(folder)) for b in PYTHON_BLOCK.findall(card)]
    runner = textwrap.dedent(f"""
        import json
        for number, block in enumerate(json.loads({json.dumps(json.dumps(blocks))})):
            print(f"=== block {{number}}", flush=True)
            exec(compile(block, f"<card block {{number}}>", "exec"), {{"__name__": "__main__"}})
        print("CARD OK")
    """)
    (tmp_path / "elsewhere").mkdir()
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", runner], cwd=tmp_path / "elsewhere", env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith("CARD OK")
    assert "torch.Size([7, 3])" in proc.stdout  # depth_attention_weights through the remote code
    assert "depthfusion_hf.models.modeling_attnres" in proc.stdout  # the "import depthfusion_hf" block uses the package


def test_heatmap_labels_and_file(tmp_path):
    rows, cols = depth_attention_labels(2, None)
    assert rows == ["1 attn", "1 mlp", "2 attn", "2 mlp", "final"] and cols == ["emb", "v1", "v2", "v3", "v4"]
    assert depth_attention_labels(3, 4)[1] == ["emb", "b1", "b2"]
    model = AttnResForCausalLM(tiny_config(attnres_block_size=3)).eval()
    randomise_attnres(model)
    weights = model.depth_attention_weights(torch.randint(3, 97, (1, 8)))
    path = plot_depth_attention_heatmap(weights, tmp_path / "sub" / "w.png", 4, 3)
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match=r"weights must have shape \[2L \+ 1, N \+ 1\] = \(9, 4\)"):
        plot_depth_attention_heatmap(weights[:, :3], tmp_path / "x.png", 4, 3)
