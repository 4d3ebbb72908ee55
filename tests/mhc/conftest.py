"""The Triton test module runs where the kernels can run (CUDA, or ``TRITON_INTERPRET=1`` set before they are
imported); a plain CPU run executes it in an interpreted child process (``test_mhc_triton_interpreted.py``) and does
not collect it here."""

from tests.kernels.interpret import kernels_run_in_process

collect_ignore = [] if kernels_run_in_process() else ["test_mhc_triton.py"]
