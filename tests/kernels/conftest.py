"""Kernel test modules that need CUDA or interpreted Triton are collected only where they can run.

On a CPU-only run, ``test_*_interpreted.py`` runs them in a child process with ``TRITON_INTERPRET=1``
(which must be set before the kernels are imported), so the parent does not collect them at all.
"""

from tests.kernels.interpret import kernels_run_in_process

KERNEL_MODULES = ["test_dwa_triton.py", "test_dwa_model_triton.py", "test_moda_triton.py", "test_attnres_triton.py",
                  "test_mhc_triton.py"]

collect_ignore = [] if kernels_run_in_process() else KERNEL_MODULES
