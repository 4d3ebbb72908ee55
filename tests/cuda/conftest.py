"""Tests of CUDA-only behaviour: collected only on a machine with a CUDA device (``scripts/gpu_check.sh`` runs them);
their CPU counterparts live beside the code they test."""

import torch

collect_ignore = [] if torch.cuda.is_available() else ["test_token_inputs_cuda.py"]
