"""README's calls for an exported folder, run as written (issue 28 §3): with only torch and transformers importable,
stdin closed and offline, ``AutoTokenizer`` / ``AutoModelForCausalLM`` / ``pipeline("text-generation")`` with
``trust_remote_code=True`` load a causal family's folder without a prompt or a warning, and the pipeline's greedy
tokens are ``model.generate``'s."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from .builders import PROMPTS
from .conftest import NEW_TOKENS

README = Path(__file__).resolve().parents[2] / "README.md"
README_FOLDER = "my-denseformer"  # the folder name README's calls use
PROMPT_OR_WARNING = ("Do you wish to run the custom code", "You are using a model of type", "trust_remote_code")

CHECK = """
import json, torch
prompt = {prompt!r}
inputs = tokenizer(prompt, return_tensors="pt")
with torch.no_grad():
    generated = model.eval().generate(**inputs, max_new_tokens={new}, min_new_tokens={new}, do_sample=False)
piped = generator(prompt, max_new_tokens={new}, min_new_tokens={new}, do_sample=False, return_tensors=True)
text = generator(prompt, max_new_tokens={new}, min_new_tokens={new}, do_sample=False)
print("REPORT" + json.dumps({{"generate": generated[0].tolist(), "pipeline": piped[0]["generated_token_ids"],
                             "decoded": tokenizer.decode(generated[0], skip_special_tokens=True),
                             "text": text[0]["generated_text"], "chat": tokenizer.chat_template is not None,
                             "module": type(model).__module__, "pipeline_module": type(generator.model).__module__}}))
"""


def readme_standalone_block() -> str:
    """README's python block that loads a folder with only torch and transformers (no ``import depthfusion_hf``)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    (block,) = [b for b in blocks if "pipeline(" in b and README_FOLDER in b and "import depthfusion_hf" not in b]
    return block


def test_readme_shows_the_three_calls_with_trust_remote_code():
    block = readme_standalone_block()
    for call in (f'AutoTokenizer.from_pretrained("{README_FOLDER}", trust_remote_code=True)',
                 f'AutoModelForCausalLM.from_pretrained("{README_FOLDER}", trust_remote_code=True)',
                 f'pipeline("text-generation", model="{README_FOLDER}", trust_remote_code=True)'):
        assert call in block, call


def test_readme_calls_load_an_exported_causal_folder_quietly_and_the_pipeline_generates_greedily(exported,
                                                                                                 tmp_path):
    item = exported["moda"]
    program = "import sys\nsys.stdin.close()\n" + readme_standalone_block().replace(README_FOLDER, str(item.folder))
    program += CHECK.format(prompt=PROMPTS[1], new=NEW_TOKENS)
    blocker = ("import importlib.abc, sys\nclass _Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('depthfusion_hf', 'triton'):\n"
               "            raise ModuleNotFoundError(name)\nsys.meta_path.insert(0, _Block())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "DEPTHFUSION"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", blocker + program], cwd=tmp_path, stdin=subprocess.DEVNULL, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for needle in PROMPT_OR_WARNING:
        assert needle not in proc.stdout and needle not in proc.stderr, (needle, proc.stderr[-2000:])
    report = json.loads(proc.stdout.split("REPORT", 1)[1])
    assert "depthfusion_hf" not in report["module"] and "depthfusion_hf" not in report["pipeline_module"]
    prompt_ids = item.tokenizer(PROMPTS[1])["input_ids"]
    assert report["generate"][: len(prompt_ids)] == prompt_ids
    assert len(report["generate"]) == len(prompt_ids) + NEW_TOKENS
    assert report["pipeline"] == report["generate"]  # the pipeline's greedy tokens are model.generate's
    assert report["text"] == report["decoded"] and report["text"] == item.expected["pipeline_text"]
