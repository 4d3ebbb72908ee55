"""``examples/serve_vllm.py`` runs as a user runs it, in the vLLM venv (``tests/examples`` runs every other example
in the main venv, which has no vLLM): a subprocess, offline, from a fresh checkout that it leaves clean; vLLM serves
the exported DenseFormer folder with the tokens of transformers' ``generate`` for every prompt."""

import subprocess
import sys
from pathlib import Path

from tests.examples.test_examples import ROOT, fresh_checkout, git

EXAMPLE = Path("examples") / "serve_vllm.py"
TIMEOUT_S = 900  # vLLM's start-up on 2 busy cores; about a minute on a quiet machine


def test_serve_vllm_example_serves_the_tokens_of_hf_generate(tmp_path):
    assert (ROOT / EXAMPLE).is_file()
    checkout = fresh_checkout(tmp_path / "checkout")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false", "HOME": str(tmp_path),
           "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLE)], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"serve_vllm.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for needle in ("[denseformer] DenseFormerForCausalLM", "modeling_denseformer.py",
                   "vLLM (eager) == transformers generate: 3/3 prompts"):
        assert needle in proc.stdout, f"{needle!r} not in the example's output:\n{proc.stdout[-3000:]}"
    assert proc.stdout.count("(vLLM tokens == HF generate: yes)") == 3
    assert git(checkout, "status", "--porcelain", "--ignored", "--untracked-files=all") == ""
