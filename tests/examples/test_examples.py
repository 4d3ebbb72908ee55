"""Every script in examples/ runs to completion as a user would run it: a subprocess, offline, on CPU, from the
root of a checkout (a fresh git repository holding examples/ and the project's .gitignore, nothing else), and
leaves that checkout clean: nothing written outside the ignored outputs/ folder or a temporary directory. The
list is globbed, so examples added by anyone are covered."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# serve_vllm.py needs vLLM, which the main venv cannot hold (its transformers pins): it runs in the vLLM venv
# (tests/serving/test_serve_example.py).
VLLM_EXAMPLES = {"serve_vllm.py"}
EXAMPLES = sorted(path for path in (ROOT / "examples").glob("*.py") if path.name not in VLLM_EXAMPLES)
# what the examples written alongside the export work must print (others' examples: exit status only)
EXPECTED_OUTPUT = {
    "quickstart.py": ["save_pretrained -> from_pretrained (DenseFormerForCausalLM): max |Δlogits| = 0.0e+00",
                      "AutoModel -> DenseFormerModel", "modeling_denseformer.py"],
    "generation.py": ["[DenseFormer 2x2]", "[MoDA (FFN-side depth KV)]", "greedy (same with and without the cache)",
                      "beam search, 4 beams, #2:", "pipeline(text-generation):"],
    "llama_upcycling.py": ["Llama -> denseformer 2x2  max |Δlogits| 0.00e+00", "Llama -> moda",
                           "Llama -> attnres block 4", "DenseFormer DWA weights moved from the identity",
                           "block AttnRes depth attention after"],
    "mhc_hyper_connections.py": ["[mHC n4]", "mHC n4: streams [1, 48, 4, 64]", "comb columns sum to 1 within",
                                 "Llama -> mhc n4  max |Δlogits|", "greedy (same with and without the cache)",
                                 "-> MHCForCausalLM: max |Δlogits| 0.0e+00"],
    "upcycle_pretrained.py": ["moda: max |Δlogit| 0 (relative 0)", "greedy text = source 3/3; gate pass"],
}
# Arguments that keep an example within the ceiling below (the real 135M model: MoDA, one training step).
EXAMPLE_ARGS = {
    "upcycle_pretrained.py": ["--families", "moda", "--steps", "1", "--batch_size", "1", "--block_size", "64",
                              "--eval_blocks", "1", "--eval_block_size", "128", "--max_new_tokens", "4"],
}
# A generous ceiling against hangs; the examples are meant to take well under two minutes on a free CPU.
TIMEOUT_S = 300


def test_examples_folder_is_populated():
    names = {path.name for path in EXAMPLES}
    assert set(EXPECTED_OUTPUT) <= names


def git(checkout: Path, *args: str) -> str:
    """Run git in ``checkout`` (no user config needed) and return its stdout."""
    command = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "init.defaultBranch=main",
               *args]
    return subprocess.run(command, cwd=checkout, check=True, capture_output=True, text=True).stdout


def fresh_checkout(folder: Path) -> Path:
    """A committed git repository at ``folder`` holding a copy of examples/ and the project's .gitignore."""
    folder.mkdir()
    shutil.copytree(ROOT / "examples", folder / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".gitignore", folder / ".gitignore")
    git(folder, "init", "-q")
    git(folder, "add", "-A")
    git(folder, "commit", "-q", "-m", "checkout")
    return folder


def test_gitignore_covers_the_examples_output_folder(tmp_path):
    checkout = fresh_checkout(tmp_path / "checkout")
    (checkout / "outputs" / "lora_denseformer").mkdir(parents=True)
    (checkout / "outputs" / "lora_denseformer" / "summary.json").write_text("{}")
    (checkout / "stray.txt").write_text("x")  # the check below does see files written elsewhere
    assert git(checkout, "status", "--porcelain", "--untracked-files=all").split() == ["??", "stray.txt"]


@pytest.mark.integration
@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example_runs(path, tmp_path):
    checkout = fresh_checkout(tmp_path / "checkout")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home"), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false",
           "HOME": str(tmp_path), "MPLBACKEND": "Agg", "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path("examples") / path.name), *EXAMPLE_ARGS.get(path.name, [])],
                          cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    seconds = time.perf_counter() - start
    print(f"{path.name}: {seconds:.1f} s")
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    for needle in EXPECTED_OUTPUT.get(path.name, []):
        assert needle in proc.stdout, f"{path.name}: {needle!r} not in its output:\n{proc.stdout[-3000:]}"
    status = git(checkout, "status", "--porcelain", "--untracked-files=all")
    assert status == "", f"{path.name} left files in the checkout it was run from:\n{status}"
    ignored = git(checkout, "status", "--porcelain", "--ignored", "--untracked-files=all").splitlines()
    outside = [line for line in ignored if not line[3:].startswith("outputs/")]
    assert not outside, f"{path.name} wrote ignored files outside outputs/: {outside}"
