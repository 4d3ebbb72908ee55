"""model_cards/: valid Hub metadata, citation and limitations, results -> model-index, and usage code that
runs as written (the card's repo id replaced by a local exported folder)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import jinja2
import pytest
from huggingface_hub import ModelCard, metadata_load

from depthfusion_hf.export import build_model_card, default_model_cards_dir
from depthfusion_hf.families import FAMILIES as REGISTRY
from depthfusion_hf.families import get_family

FAMILIES = ("denseformer", "moda", "dwatt")
ARXIV = {"denseformer": "2402.02622", "moda": "2603.15619", "dwatt": "2209.15168"}
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


@pytest.mark.parametrize("family", FAMILIES)
def test_template_has_valid_hub_metadata_citation_and_limitations(family):
    path = default_model_cards_dir() / get_family(family).card_template
    meta = metadata_load(path)
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == get_family(family).pipeline_tag
    assert {"custom_code", family} <= set(meta["tags"])
    assert meta["license"] == "apache-2.0" and meta["datasets"]
    text = path.read_text()
    card = ModelCard(text)  # the Hub's own parser accepts the template as it stands
    assert card.data.library_name == "transformers"
    assert "## Limitations" in text and "## Usage" in text
    (bibtex,) = re.findall(r"```bibtex\n(.*?)```", text, re.DOTALL)
    assert re.match(r"@(inproceedings|article)\{\w+,", bibtex.strip())
    assert bibtex.count("{") == bibtex.count("}") and "title" in bibtex and "author" in bibtex
    assert ARXIV[family] in bibtex
    blocks = PYTHON_BLOCK.findall(text)
    assert len(blocks) >= 3 and all("{{ repo_id }}" in block for block in blocks)
    assert any("trust_remote_code=True" in b for b in blocks) and any("import depthfusion_hf" in b for b in blocks)


@pytest.mark.parametrize("family", sorted(REGISTRY))
def test_every_registered_template_is_jinja_with_hub_metadata(family):
    """Every family's template parses as Jinja (BibTeX's ``{{Team}}`` would not) and as Hub metadata."""
    path = default_model_cards_dir() / get_family(family).card_template
    jinja2.Environment().parse(path.read_text(encoding="utf-8"))
    meta = metadata_load(path)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == get_family(family).pipeline_tag


def test_a_template_placeholder_without_a_value_is_refused_naming_it(exported, tmp_path):
    model = exported["denseformer"].model
    (tmp_path / "denseformer.md").write_text("---\nlicense: mit\n---\n{{ repo_id }} {{ dwa_dilaton }}\n")
    with pytest.raises(ValueError, match="dwa_dilaton"):
        build_model_card(model, "me/x", template_dir=tmp_path)
    (tmp_path / "denseformer.md").write_text("---\nlicense: mit\n---\n{{ repo_id }} k={{dwa_dilation}}\n")
    assert build_model_card(model, "me/x", template_dir=tmp_path).endswith("me/x k=2\n")


def test_results_become_a_valid_model_index(exported):
    item = exported["dwatt"]
    entries = [{"task_type": "token-classification", "task_name": "NER", "dataset_type": "wnut_16",
                "dataset_name": "WNUT-16 (held-out test)", "dataset_split": "test", "metric_type": "f1",
                "metric_name": "entity F1", "value": 0.4321}]
    text = build_model_card(item.model, "me/dwatt-wnut16", results=entries, dataset="wnut_16")
    card = ModelCard(text)
    (result,) = card.data.eval_results
    assert (result.task_type, result.dataset_type, result.dataset_split) == ("token-classification", "wnut_16", "test")
    assert (result.metric_type, result.metric_value) == ("f1", 0.4321)
    assert card.data.model_name == "dwatt-wnut16"
    assert "| WNUT-16 (held-out test) | entity F1 | 0.4321 |" in text


def test_card_usage_code_runs_as_written(exported, tmp_path):
    """Every python block of each exported card, with the card's repo id replaced by the local folder, runs
    in a new interpreter (offline, from another directory)."""
    programs = {}
    for family in FAMILIES:
        item = exported[family]
        blocks = PYTHON_BLOCK.findall((item.folder / "README.md").read_text())
        assert blocks and all(item.repo_id in block for block in blocks)
        programs[family] = [block.replace(item.repo_id, str(item.folder)) for block in blocks]
    runner = textwrap.dedent(f"""
        import json, sys
        programs = json.loads({json.dumps(json.dumps(programs))})
        for family, blocks in programs.items():
            for number, block in enumerate(blocks):
                print(f"=== {{family}} block {{number}}", flush=True)
                exec(compile(block, f"<{{family}} card block {{number}}>", "exec"), {{"__name__": "__main__"}})
        print("CARDS OK")
    """)
    (tmp_path / "elsewhere").mkdir()
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", runner], cwd=tmp_path / "elsewhere", env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert out.rstrip().endswith("CARDS OK")
    assert "torch.Size([5, 6])" in out  # DenseFormer dwa_weights() shape printed by the card
    assert out.count("depthfusion_hf.models.") == 3  # the "import depthfusion_hf" blocks use the package's classes
    assert "torch.Size([1, " in out  # DWAtt logits / depth-attention shapes
