"""Multi-seed, multi-depth studies of the causal-LM families against the same Llama (issue 12), one job per module:

- :mod:`.specs`: the model specs (``llama``, ``denseformer:4x5``, ``moda:no-ffn-kv``, ``attnres:block8`` = 8 blocks,
  ``family:field=value``), read from the family registry;
- :mod:`.data`: one corpus, one tokenizer, packed train / validation (/ test) blocks;
- :mod:`.store`: one JSON file per finished run, written atomically; resume and the refusal of other settings;
- :mod:`.training`: one run of the recipe's ``train_one``, timed with evaluation excluded;
- :mod:`.grids`: the comparison grid (``scripts/compare_families.py``) and the continuations
  (``scripts/upcycle.py``);
- :mod:`.stats`: paired differences with Student-t intervals, curves read at a given time;
- :mod:`.tables`: the markdown reports.
"""
