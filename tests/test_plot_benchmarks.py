"""``benchmarks/plot_benchmarks.py``: plots the committed records; a missing kind is skipped, with a message."""

import importlib.util
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "docs" / "bench"
KINDS = ("dwa", "models", "moda_attention")


def _load_script():
    spec = importlib.util.spec_from_file_location("plot_benchmarks", REPO / "benchmarks" / "plot_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plots_from_committed_records(tmp_path, capsys):
    plot = _load_script()
    assert plot.main(["--out", str(tmp_path)]) == 0
    for kind in KINDS:
        png = tmp_path / f"{kind}.png"
        assert png.is_file(), kind
        assert png.stat().st_size > 5 * 1024, kind
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "skipped" not in capsys.readouterr().err


def test_missing_kind_is_skipped_with_message(tmp_path, capsys):
    plot = _load_script()
    bench = tmp_path / "bench"
    bench.mkdir()
    shutil.copy(BENCH / "dwa.jsonl", bench / "dwa.jsonl")
    (bench / "models.jsonl").write_text("")  # present but empty
    out = tmp_path / "out"  # moda_attention.jsonl absent
    assert plot.main(["--bench-dir", str(bench), "--out", str(out), "--kinds", "dwa", "models", "moda_attention"]) == 1
    err = capsys.readouterr().err
    assert "skipped models.png" in err and "no record with results" in err
    assert "skipped moda_attention.png" in err and "does not exist" in err
    assert (out / "dwa.png").stat().st_size > 5 * 1024
    assert not (out / "models.png").exists() and not (out / "moda_attention.png").exists()


def test_commit_selects_record_and_unknown_commit_is_skipped(tmp_path, capsys):
    plot = _load_script()
    record = plot.load_record(BENCH / "models.jsonl", "0c14725")
    assert record["commit"] == "0c14725"
    assert plot.main(["--kinds", "models", "--commit", "0000000", "--out", str(tmp_path)]) == 1
    assert "no record for commit 0000000" in capsys.readouterr().err
