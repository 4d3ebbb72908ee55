"""transformers' own common model tests (from the installed version's sdist) and our generation tests, run against
every family and variant with transformers' Llama as the control (see ``upstream.py`` and ``testers.py``)."""
