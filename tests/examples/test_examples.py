"""Every script in examples/ runs to completion as a user would run it: a subprocess, offline, from another
directory, on CPU. The list is globbed, so examples added by anyone are covered."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))
# what the examples written alongside the export work must print (others' examples: exit status only)
EXPECTED_OUTPUT = {
    "quickstart.py": ["save_pretrained -> from_pretrained (DenseFormerForCausalLM): max |Δlogits| = 0.0e+00",
                      "AutoModel -> DenseFormerModel", "modeling_denseformer.py"],
    "generation.py": ["[DenseFormer 2x2]", "[MoDA (FFN-side depth KV)]", "greedy (same with and without the cache)",
                      "beam search, 4 beams, #2:", "pipeline(text-generation):"],
    "llama_upcycling.py": ["Llama -> DenseFormer 2x2     max |Δlogits| 0.00e+00", "Llama -> MoDA",
                           "DenseFormer DWA weights moved from the identity"],
}
# A generous ceiling against hangs; the examples are meant to take well under two minutes on a free CPU.
TIMEOUT_S = 300


def test_examples_folder_is_populated():
    names = {path.name for path in EXAMPLES}
    assert set(EXPECTED_OUTPUT) <= names


@pytest.mark.integration
@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example_runs(path, tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home"), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false",
           "HOME": str(tmp_path), "MPLBACKEND": "Agg"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    seconds = time.perf_counter() - start
    print(f"{path.name}: {seconds:.1f} s")
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    for needle in EXPECTED_OUTPUT.get(path.name, []):
        assert needle in proc.stdout, f"{path.name}: {needle!r} not in its output:\n{proc.stdout[-3000:]}"
