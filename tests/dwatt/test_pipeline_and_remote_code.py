"""The token-classification pipeline and the remote-code export (fresh process, no depthfusion_hf)."""

import json

import pytest
import torch
from transformers import pipeline

from depthfusion_hf.data import tokenize_and_align
from depthfusion_hf.export import save_remote_code_folder
from tests.fresh_process import run_fresh

from .helpers import tiny_model, tiny_tokenizer


def overfit(model, tokenizer, sentences: list[tuple[list[str], list[str]]], steps: int = 80) -> None:
    """Train ``model`` on a few labelled sentences until it reproduces them (tiny model, ~1 s)."""
    batch = tokenize_and_align({"tokens": [s[0] for s in sentences], "ner_tags": [s[1] for s in sentences]},
                               tokenizer, model.config.label2id)
    width = max(len(ids) for ids in batch["input_ids"])
    labels = torch.tensor([row + [-100] * (width - len(row)) for row in batch.pop("labels")])
    batch = dict(tokenizer.pad(batch, return_tensors="pt"), labels=labels)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def test_pipeline_with_simple_aggregation(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    model = tiny_model("dwatt", classifier_dropout=0.0)
    overfit(model, tokenizer, [
        (["john", "smith", "visited", "paris", "today"], ["B-PER", "I-PER", "O", "B-LOC", "O"]),
        (["ann", "went", "to", "new", "york"], ["B-PER", "O", "O", "B-LOC", "I-LOC"]),
    ])
    ner = pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy="simple")
    entities = ner("John Smith visited Paris today")
    assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in entities] == [
        ("PER", "john smith", 0, 10), ("LOC", "paris", 19, 24)]
    assert all(0.5 < e["score"] <= 1.0 for e in entities)


@pytest.mark.integration
def test_remote_code_export_loads_in_a_fresh_process(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    text = "john smith visited new york"
    expected = {}
    for fusion in ("dwatt", "deeper"):  # one fresh interpreter for both: importing transformers is the slow part
        model = tiny_model(fusion)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
            expected[fusion] = model(**tokenizer(text, return_tensors="pt"), output_depth_attentions=True)
        folder = tmp_path / fusion
        save_remote_code_folder(model, folder, tokenizer)
        for name in ("configuration_dwatt.py", "modeling_dwatt.py", "fusion_dwatt.py", "sizes_dwatt.py"):
            assert (folder / name).is_file(), name
    out = run_fresh(
        f"""
        import json, torch
        from transformers import AutoModelForTokenClassification, AutoTokenizer, pipeline
        torch.set_num_threads(1)
        result = {{}}
        for fusion in ("dwatt", "deeper"):
            folder = {str(tmp_path)!r} + "/" + fusion
            model = AutoModelForTokenClassification.from_pretrained(folder, trust_remote_code=True).eval()
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
            with torch.no_grad():
                out = model(**tokenizer({text!r}, return_tensors="pt"), output_depth_attentions=True)
            ner = pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy="simple",
                           trust_remote_code=True)
            result[fusion] = {{"module": type(model).__module__, "fusion": model.config.fusion,
                               "logits": out.logits.tolist(),
                               "depth": None if out.depth_attentions is None else out.depth_attentions.tolist(),
                               "entities": ner({text!r})}}
        print(json.dumps(result, default=str))
        """,
        cwd=str(tmp_path),
        hf_home=str(tmp_path / "hf_home"),
    )
    result = json.loads(out[out.index("{"):])
    for fusion in ("dwatt", "deeper"):
        got = result[fusion]
        assert got["module"].startswith("transformers_modules.") and got["fusion"] == fusion
        torch.testing.assert_close(torch.tensor(got["logits"]), expected[fusion].logits, rtol=0, atol=1e-5)
        assert all(set(e) >= {"entity_group", "word", "start", "end"} for e in got["entities"])
    torch.testing.assert_close(torch.tensor(result["dwatt"]["depth"]), expected["dwatt"].depth_attentions,
                               rtol=0, atol=1e-6)
    assert result["deeper"]["depth"] is None
