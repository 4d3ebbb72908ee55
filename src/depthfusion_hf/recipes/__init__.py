"""Training recipes: the causal-LM comparison (``clm``) and few-shot NER with DWAtt (``ner``)."""
