"""The built wheel: it holds the package data (the shared model module, the card templates), and a remote-code folder
of every registered family saved from the wheel's install loads in a fresh process without depthfusion_hf or Triton
with identical logits (the editable install's side is ``tests/test_remote_code_and_convert.py``)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from depthfusion_hf.families import FAMILIES
from tests.fresh_process import run_fresh

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "depthfusion_hf"

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this checkout's files (tracked and untracked, not ignored: a stale ignored ``build/`` would leak
    into the wheel, and the build leaves nothing in the checkout), built once per module with build isolation."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout
    for name in filter(None, listed.split("\0")):
        path, copy = REPO / name, source / name
        if path.is_symlink() or path.is_file():  # a deleted but still tracked file is skipped
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, copy, follow_symlinks=False)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out),
                    str(source)], check=True, timeout=600)
    (built,) = out.glob("depthfusion_hf-*.whl")
    return built


def test_wheel_holds_every_module_and_card_template(wheel):
    """Every ``.py`` file of the source package is in the wheel (``models/depthfusion_common.py``, which each saved
    folder needs, among them), and every family's card template (package data)."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    sources = {f"depthfusion_hf/{path.relative_to(PACKAGE).as_posix()}" for path in PACKAGE.rglob("*.py")}
    assert "depthfusion_hf/models/depthfusion_common.py" in sources
    assert sources - names == set()
    templates = {f"depthfusion_hf/model_cards/{family.card_template}" for family in FAMILIES.values()}
    assert len(templates) == len(FAMILIES)
    assert templates - names == set()


def test_folders_saved_from_the_wheel_load_without_the_package(wheel, tmp_path):
    """Install the wheel into a folder of its own, save every family from that install (``depthfusion_hf.__file__``
    is checked to lie there), and load each folder where neither depthfusion_hf nor Triton can be imported."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target),
                    str(wheel)], check=True, timeout=600)
    saved = tmp_path / "saved"
    save = textwrap.dedent(f"""
        import json, sys, torch
        sys.path = [{str(target)!r}] + [p for p in sys.path if not p.startswith({str(REPO / "src")!r})]
        import depthfusion_hf
        assert depthfusion_hf.__file__.startswith({str(target)!r}), depthfusion_hf.__file__
        from depthfusion_hf.export import save_remote_code_folder
        from depthfusion_hf.families import FAMILIES
        from tests.dwatt.helpers import tiny_model as tiny_dwatt
        from tests.family_cases import tiny_model
        ids = torch.randint(3, 30, (2, 9), generator=torch.Generator().manual_seed(0))
        expected = {{}}
        for family in FAMILIES:
            model = tiny_dwatt() if family == "dwatt" else tiny_model(family)
            with torch.no_grad():
                expected[family] = model(ids).logits
            save_remote_code_folder(model, {str(saved)!r} + "/" + family)
        torch.save(dict(ids=ids, logits=expected), {str(saved / "expected.pt")!r})
        print("FILE", json.dumps(depthfusion_hf.__file__))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    proc = subprocess.run([sys.executable, "-c", save], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.split("FILE", 1)[1]).startswith(str(target))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_fresh(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
        expected = torch.load({str(saved / "expected.pt")!r})
        report = {{}}
        for family, logits in expected["logits"].items():
            auto = AutoModelForTokenClassification if family == "dwatt" else AutoModelForCausalLM
            model = auto.from_pretrained({str(saved)!r} + "/" + family, trust_remote_code=True).eval()
            with torch.no_grad():
                report[family] = dict(module=type(model).__module__,
                                      equal=torch.equal(model(expected["ids"]).logits, logits))
        print("REPORT", json.dumps(report))
        """,
        cwd=str(elsewhere),
        hf_home=str(tmp_path / "hf_home"),
    )
    report = json.loads(out.split("REPORT", 1)[1])
    assert sorted(report) == sorted(FAMILIES)
    for family, loaded in report.items():
        assert loaded["module"].startswith("transformers_modules."), (family, loaded)
        assert loaded["equal"], (family, loaded)


def test_the_fresh_process_really_blocks_the_package(tmp_path):
    """The loader above proves something only if the fresh process cannot import depthfusion_hf or Triton."""
    out = run_fresh("""
        import importlib
        for name in ("depthfusion_hf", "triton"):
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                print(name, "blocked")
        """, cwd=str(tmp_path), hf_home=str(tmp_path / "hf_home"))
    assert out.split() == ["depthfusion_hf", "blocked", "triton", "blocked"]

