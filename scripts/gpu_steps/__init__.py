"""The steps of ``scripts/gpu_check.sh``: one module each, run by ``scripts/gpu_check.py`` in its own process."""
