"""One export of each family per test session, with the outputs the parent process expects back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import pipeline

from depthfusion_hf.export import export_model

from .builders import NER_TEXT, PROMPTS, tiny_denseformer, tiny_dwatt, tiny_moda

NEW_TOKENS = 6


@dataclass
class Exported:
    """An exported folder, the model it came from, and the file holding the expected outputs."""

    family: str
    folder: Path
    repo_id: str
    model: torch.nn.Module
    tokenizer: object
    expected: dict


def _entities(raw: list[dict]) -> list[dict]:
    return [{"entity_group": e["entity_group"], "word": e["word"], "start": int(e["start"]), "end": int(e["end"]),
             "score": float(e["score"])} for e in raw]


@torch.no_grad()
def _expected_lm(model, tokenizer) -> dict:
    batch = tokenizer(PROMPTS[0], return_tensors="pt")
    ids = torch.randint(3, len(tokenizer), (2, 11), generator=torch.Generator().manual_seed(1))
    generated = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = generator(PROMPTS[1], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return {"ids": ids.tolist(), "logits": model(ids).logits.tolist(), "prompt_ids": batch["input_ids"].tolist(),
            "generated": generated.tolist(), "pipeline_text": text[0]["generated_text"]}


@torch.no_grad()
def _expected_dwatt(model, tokenizer) -> dict:
    batch = tokenizer([NER_TEXT], return_tensors="pt")
    logits = model(**batch).logits
    tagger = pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy="simple")
    return {"input_ids": batch["input_ids"].tolist(), "logits": logits.tolist(),
            "predictions": logits.argmax(-1).tolist(), "entities": _entities(tagger(NER_TEXT))}


@pytest.fixture(scope="session")
def exported(tmp_path_factory) -> dict[str, Exported]:
    """``{"denseformer" | "moda" | "dwatt": Exported}``, folders named after the family under one temp dir."""
    root = tmp_path_factory.mktemp("exports")
    out: dict[str, Exported] = {}
    for family, build in (("denseformer", tiny_denseformer), ("moda", tiny_moda), ("dwatt", tiny_dwatt)):
        model, tokenizer = build()
        repo_id = f"me/{family}-tiny"
        folder = export_model(model, root / family, tokenizer=tokenizer, repo_id=repo_id)
        expected = _expected_dwatt(model, tokenizer) if family == "dwatt" else _expected_lm(model, tokenizer)
        (root / f"{family}.expected.json").write_text(json.dumps(expected))
        out[family] = Exported(family, folder, repo_id, model, tokenizer, expected)
    return out
