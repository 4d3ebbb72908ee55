"""Training recipes (causal LM; the few-shot NER recipe lives beside it)."""
