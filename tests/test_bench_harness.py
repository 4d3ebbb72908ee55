"""``benchmarks/harness.py``: the order of interleaved repeats, paired ratios and their spread, the record header and
the JSONL file, and another checkout's family folders imported under other names."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from .test_bench_models import REPO, load_benchmark


def test_interleave_reverses_the_order_every_other_repeat_and_times_each_call():
    harness = load_benchmark("harness")
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    times = harness.interleave(calls, 3, torch.device("cpu"), warmup=1)
    assert order == ["a", "b", "c"] + ["a", "b", "c"] + ["c", "b", "a"] + ["a", "b", "c"]
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for values in times.values() for t in values)
    with pytest.raises(ValueError, match="reps must be >= 1"):
        harness.interleave(calls, 0, torch.device("cpu"))


def test_paired_ratios_and_their_spread():
    harness = load_benchmark("harness")
    spread = harness.paired([2.0, 3.0, 8.0], [1.0, 2.0, 4.0])
    assert spread.values == (2.0, 1.5, 2.0) and (spread.median, spread.min, spread.max) == (2.0, 1.5, 2.0)
    assert spread.text() == "2.000 [1.500, 2.000]"
    assert spread.as_record() == {"median": 2.0, "min": 1.5, "max": 2.0, "values": [2.0, 1.5, 2.0]}
    with pytest.raises(ValueError, match="equal, non-empty"):
        harness.paired([1.0], [1.0, 2.0])
    assert harness.meets(0.9, 0.82, higher_is_better=True) and not harness.meets(1.2, 1.12, higher_is_better=False)


def test_record_header_and_jsonl(tmp_path):
    harness = load_benchmark("harness")
    header = harness.record_header(torch.device("cpu"), ["--reps", "3"], label="x")
    assert header["command"].endswith("--reps 3") and header["label"] == "x" and header["device"] == "cpu"
    assert header["torch"] == torch.__version__ and "load_1min" in header["load"] and header["machine"]
    import depthfusion_hf

    assert header["package"] == str(Path(depthfusion_hf.__file__).resolve().parent)
    assert header["package_dirty"] in (True, False, None) and header["package_commit"]
    path = tmp_path / "sub" / "r.jsonl"
    harness.append_record(path, dict(header, results=[1]))
    harness.append_record(path, dict(header, results=[2]))
    assert [json.loads(line)["results"] for line in path.read_text().splitlines()] == [[1], [2]]


def test_family_folders_of_another_checkout_load_under_other_names(tmp_path, capsys):
    harness = load_benchmark("harness")
    checkout = tmp_path / "old"
    models = checkout / "src" / "depthfusion_hf" / "models"
    models.mkdir(parents=True)
    (models / "__init__.py").write_text("")
    pending = ["configuration_denseformer.py", "modeling_denseformer.py", "dwa.py", "dwa_triton.py"]
    while pending:  # the DenseFormer's files and, transitively, the same-folder modules they import
        name = pending.pop()
        shutil.copy(REPO / "src" / "depthfusion_hf" / "models" / name, models / name)
        pending += [f"{line.split()[1][1:]}.py" for line in (models / name).read_text().splitlines()
                    if line.startswith("from .") and not (models / f"{line.split()[1][1:]}.py").exists()]
    loaded = harness.load_before_families(checkout, ["denseformer", "moda"])
    assert list(loaded) == ["denseformer"] and "no moda package" in capsys.readouterr().out
    module = loaded["denseformer"]
    assert module.__name__ == "denseformer_before"
    assert module.DenseFormerConfig.__module__ == "denseformer_before.configuration_denseformer"
    import depthfusion_hf

    assert module.DenseFormerForCausalLM is not depthfusion_hf.DenseFormerForCausalLM
    assert harness.family_folder(models, "denseformer") == models  # a models folder given directly
    old_layout = tmp_path / "older" / "src" / "depthfusion_hf" / "models" / "denseformer"
    old_layout.mkdir(parents=True)
    (old_layout / "__init__.py").write_text("")
    assert harness.family_folder(old_layout.parents[3], "denseformer") == old_layout  # the layout before one folder
    assert harness.family_folder(old_layout, "moda") == old_layout.parent / "moda"  # and its siblings
    with pytest.raises(FileNotFoundError, match="no __init__.py"):
        harness.load_family_folder(tmp_path / "nothing", "moda", "moda_nothing")
