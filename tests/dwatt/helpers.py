"""Tiny random encoders, a tiny WordPiece tokenizer and labels for the DWAtt tests."""

from __future__ import annotations

from pathlib import Path

from transformers import BertConfig, BertTokenizerFast, DebertaV2Config, GPT2Config, PreTrainedConfig, RobertaConfig

from depthfusion_hf import DWAttConfig, DWAttForTokenClassification

LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
ID2LABEL = dict(enumerate(LABELS))
LABEL2ID = {label: i for i, label in ID2LABEL.items()}
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "john", "smith", "lives", "in", "new", "york", "paris",
         "visited", "today", ".", "##er", "##s", "ann", "went", "to"]


def tiny_backbone_config(kind: str = "bert", layers: int = 2) -> PreTrainedConfig:
    """A random encoder config, 32 wide, with ``layers`` layers: ``bert``, ``roberta``, ``deberta-v2`` or ``gpt2``
    (64 positions; GPT-2 keeps its position table in ``wpe``, not ``embeddings.position_embeddings``)."""
    common = dict(vocab_size=len(VOCAB) + 10, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  intermediate_size=37, max_position_embeddings=64)
    if kind == "bert":
        return BertConfig(**common)
    if kind == "roberta":
        return RobertaConfig(**common, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    if kind == "deberta-v2":
        return DebertaV2Config(**common, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"])
    if kind == "gpt2":
        return GPT2Config(vocab_size=common["vocab_size"], n_embd=32, n_layer=layers, n_head=4, n_positions=64,
                          bos_token_id=0, eos_token_id=0)
    raise ValueError(kind)


def tiny_config(fusion: str = "dwatt", kind: str = "bert", layers: int = 2, **kwargs) -> DWAttConfig:
    """A ``DWAttConfig`` over a tiny encoder, with the five PER/LOC labels."""
    return DWAttConfig(backbone_config=tiny_backbone_config(kind, layers), fusion=fusion, id2label=ID2LABEL,
                       label2id=LABEL2ID, **kwargs)


def tiny_model(fusion: str = "dwatt", kind: str = "bert", layers: int = 2, **kwargs) -> DWAttForTokenClassification:
    """A randomly initialised tiny model in eval mode."""
    return DWAttForTokenClassification(tiny_config(fusion, kind, layers, **kwargs)).eval()


def tiny_tokenizer(folder: Path) -> BertTokenizerFast:
    """A lower-casing WordPiece tokenizer over ``VOCAB``, also saved to ``folder``."""
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(dict.fromkeys(VOCAB))})
    tokenizer.save_pretrained(folder)
    return tokenizer
