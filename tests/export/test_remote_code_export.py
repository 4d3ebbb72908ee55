"""The exported folders of all three families, end to end: reloaded with remote code in a fresh process
(no depthfusion_hf, no Triton, offline, another directory) and through the registered Auto classes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, pipeline

from tests.fresh_process import _BLOCKER, run_fresh

from .builders import NER_TEXT, PROMPTS
from .conftest import NEW_TOKENS, _entities

CHILD = """
import json, torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForTokenClassification, pipeline
root = {root!r}
report = {{}}
for family in ("denseformer", "moda"):
    folder, expected = f"{{root}}/{{family}}", json.load(open(f"{{root}}/{{family}}.expected.json"))
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        logits = model(torch.tensor(expected["ids"])).logits
        generated = model.generate(torch.tensor(expected["prompt_ids"]), max_new_tokens={new}, min_new_tokens={new},
                                   do_sample=False)
    generator = pipeline("text-generation", model=folder, trust_remote_code=True)
    text = generator({prompt!r}, max_new_tokens={new}, min_new_tokens={new}, do_sample=False)[0]["generated_text"]
    report[family] = dict(
        cls=type(model).__name__, module=type(model).__module__, base=type(base).__name__,
        pipeline_module=type(generator.model).__module__,
        logits_diff=(logits - torch.tensor(expected["logits"])).abs().max().item(),
        generated=generated.tolist(), pipeline_text=text)
folder, expected = f"{{root}}/dwatt", json.load(open(f"{{root}}/dwatt.expected.json"))
model = AutoModelForTokenClassification.from_pretrained(folder, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(input_ids=torch.tensor(expected["input_ids"])).logits
tagger = pipeline("token-classification", model=folder, aggregation_strategy="simple", trust_remote_code=True)
report["dwatt"] = dict(
    cls=type(model).__name__, module=type(model).__module__, pipeline_module=type(tagger.model).__module__,
    logits_diff=(logits - torch.tensor(expected["logits"])).abs().max().item(),
    predictions=logits.argmax(-1).tolist(),
    entities=[dict(entity_group=e["entity_group"], word=e["word"], start=int(e["start"]), end=int(e["end"]),
                   score=float(e["score"])) for e in tagger({text!r})])
print("REPORT" + json.dumps(report))
"""


def _same_entities(got: list[dict], want: list[dict]) -> None:
    assert [{k: v for k, v in e.items() if k != "score"} for e in got] == [
        {k: v for k, v in e.items() if k != "score"} for e in want]
    for a, b in zip(got, want):
        assert abs(a["score"] - b["score"]) <= 1e-5


def test_exported_folders_reload_with_remote_code_in_fresh_process(exported, tmp_path):
    root = exported["denseformer"].folder.parent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_fresh(CHILD.format(root=str(root), new=NEW_TOKENS, prompt=PROMPTS[1], text=NER_TEXT),
                    cwd=str(elsewhere), hf_home=str(tmp_path / "hf_home"))
    report = json.loads(out.split("REPORT", 1)[1])
    for family, cls, base in (("denseformer", "DenseFormerForCausalLM", "DenseFormerModel"),
                              ("moda", "MoDAForCausalLM", "MoDAModel")):
        got, want = report[family], exported[family].expected
        assert (got["cls"], got["base"]) == (cls, base)
        assert "depthfusion_hf" not in got["module"] and "depthfusion_hf" not in got["pipeline_module"]
        assert got["logits_diff"] <= 1e-5, (family, got["logits_diff"])
        assert got["generated"] == want["generated"]
        assert len(got["generated"][0]) == len(want["prompt_ids"][0]) + NEW_TOKENS
        assert got["pipeline_text"] == want["pipeline_text"]
    got, want = report["dwatt"], exported["dwatt"].expected
    assert got["cls"] == "DWAttForTokenClassification" and "depthfusion_hf" not in got["module"]
    assert "depthfusion_hf" not in got["pipeline_module"]
    assert got["logits_diff"] <= 1e-5
    assert got["predictions"] == want["predictions"]
    assert len(want["entities"]) >= 2  # the test model does tag entities, so the comparison means something
    _same_entities(got["entities"], want["entities"])


def test_exported_folders_load_through_registered_auto_classes(exported):
    """``import depthfusion_hf`` + no ``trust_remote_code``: the package's own classes serve the pipelines."""
    for family in ("denseformer", "moda"):
        item = exported[family]
        model = AutoModelForCausalLM.from_pretrained(item.folder).eval()
        assert type(model).__module__.startswith("depthfusion_hf.models")
        with torch.no_grad():
            logits = model(torch.tensor(item.expected["ids"])).logits
        assert (logits - torch.tensor(item.expected["logits"])).abs().max().item() <= 1e-5
        generator = pipeline("text-generation", model=str(item.folder))
        assert type(generator.model).__module__.startswith("depthfusion_hf.models")
        text = generator(PROMPTS[1], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert text[0]["generated_text"] == item.expected["pipeline_text"]
        assert text[0]["generated_text"].startswith(PROMPTS[1]) and text[0]["generated_text"] != PROMPTS[1]
    item = exported["dwatt"]
    model = AutoModelForTokenClassification.from_pretrained(item.folder).eval()
    assert type(model).__module__.startswith("depthfusion_hf.models")
    tagger = pipeline("token-classification", model=str(item.folder), aggregation_strategy="simple")
    assert type(tagger.model).__module__.startswith("depthfusion_hf.models")
    _same_entities(_entities(tagger(NER_TEXT)), item.expected["entities"])


LOAD_LIKE_ANY_MODEL = """
import json, sys
from transformers import AutoTokenizer, PreTrainedTokenizerFast, pipeline
folder, prompt = sys.argv[1], sys.argv[2]
report = {}
for name, load in (("auto", lambda: AutoTokenizer.from_pretrained(folder, trust_remote_code=True)),
                   ("fast", lambda: PreTrainedTokenizerFast.from_pretrained(folder))):
    tokenizer = load()
    report[name] = {"ids": tokenizer(prompt)["input_ids"], "chat": tokenizer.chat_template}
generator = pipeline("text-generation", model=folder, trust_remote_code=True)
report["pipeline"] = generator(prompt, max_new_tokens={new}, min_new_tokens={new}, do_sample=False)[0]["generated_text"]
report["pipeline_module"] = type(generator.model).__module__
print("REPORT" + json.dumps(report))
"""


def test_an_exported_tokenizer_and_pipeline_load_without_a_prompt_or_a_warning(exported, tmp_path):
    """Issue 28 §3, with only torch and transformers and stdin closed: the tokenizer loads through
    ``AutoTokenizer`` (``trust_remote_code=True`` only runs the config's code) and as a plain fast tokenizer,
    and ``pipeline("text-generation", model=folder, trust_remote_code=True)`` generates what the model does;
    transformers neither asks "Do you wish to run the custom code?" nor warns about the model type."""
    item = exported["denseformer"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "DEPTHFUSION"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    script = _BLOCKER.format(blocked={"depthfusion_hf", "triton"}) + LOAD_LIKE_ANY_MODEL.replace("{new}",
                                                                                                str(NEW_TOKENS))
    proc = subprocess.run([sys.executable, "-c", script, str(item.folder), PROMPTS[1]], cwd=tmp_path,
                          stdin=subprocess.DEVNULL, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for needle in ("Do you wish to run the custom code", "trust_remote_code", "You are using a model of type"):
        assert needle not in proc.stdout and needle not in proc.stderr, (needle, proc.stdout, proc.stderr[-2000:])
    report = json.loads(proc.stdout.split("REPORT", 1)[1])
    want = item.tokenizer(PROMPTS[1])["input_ids"]
    assert report["auto"]["ids"] == report["fast"]["ids"] == want
    assert report["pipeline"] == item.expected["pipeline_text"] and "depthfusion_hf" not in report["pipeline_module"]
