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


def test_a_record_with_its_own_targets_is_drawn_against_them_by_exact_name(tmp_path):
    """Today's bench_models.py stores its bounds: the plot draws them over the models they name (``moda``, not
    ``moda-before``), and the bars are the medians of the paired ratios."""
    plot = _load_script()
    rows = [dict(model=m, train_ratio_paired_median=t, peak_ratio=p, decode_ratio_paired_median=d)
            for m, t, p, d in (("llama", 1.0, 1.0, 1.0), ("moda", 1.2, 1.1, 0.85), ("moda-before", 1.25, 1.1, 0.84))]
    record = dict(machine="m", torch="t", commit="c", date="d", args={}, results=rows,
                  targets={"moda": {"train": 1.30, "peak": 1.25, "decode": 0.80}})
    targets = plot.recorded_targets(record, "decode")
    assert targets == [("moda", 0.80, "≥ 0.8")]
    assert plot._targets_for(["llama", "moda", "moda-before"], targets, exact=True) == [(1, 0.80, "≥ 0.8")]
    assert len(plot._targets_for(["llama", "moda", "moda-before"], targets)) == 2  # old records: prefixes
    png = plot.plot_models(record, tmp_path / "models.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5 * 1024
