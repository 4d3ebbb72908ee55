"""Run Python code in a fresh interpreter where ``depthfusion_hf`` (and optionally Triton) cannot be imported.

Used by the remote-code tests: an exported folder must load with ``trust_remote_code=True`` in a
process that has only torch and transformers, from another working directory, offline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_BLOCKER = '''
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    BLOCKED = {blocked!r}
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None
sys.meta_path.insert(0, _Block())
'''


def run_fresh(code: str, cwd: str, hf_home: str, block: tuple[str, ...] = ("depthfusion_hf", "triton"),
              timeout: int = 300) -> str:
    """Run ``code`` in a new interpreter in ``cwd`` with the given packages unimportable; return stdout.

    Raises AssertionError with the child's stderr when it exits non-zero.
    """
    script = _BLOCKER.format(blocked=set(block)) + textwrap.dedent(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "DEPTHFUSION"))}
    env.update(HF_HOME=hf_home, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"fresh process failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout
