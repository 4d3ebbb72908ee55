"""The `# Copied from depthfusion_hf....` markers: every marked copy in src/ matches its original, and the
checker itself finds drift (functions, methods, nested classes, decorators), applies `with A->B` replacements,
and rewrites drifted copies with --fix."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
CHECKER = REPO / "utils" / "check_copies.py"


def _load_checker():
    """``utils/check_copies.py`` (a development tool outside the package), imported from its file."""
    spec = importlib.util.spec_from_file_location("check_copies", CHECKER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_checker = _load_checker()
apply_replacements, check_copies, list_markers = (_checker.apply_replacements, _checker.check_copies,
                                                  _checker.list_markers)
main, parse_replacements = _checker.main, _checker.parse_replacements


def test_every_marked_copy_in_src_matches_its_original():
    markers = list_markers(SRC)
    assert len(markers) >= 4, "the family folders' copies carry markers; none found means the scan is broken"
    problems = check_copies(SRC)
    report = "\n".join(f"{problem}\n{problem.diff}" for problem in problems)
    assert not problems, (f"{len(problems)} marked cop(ies) drifted; run `python utils/check_copies.py --fix`:\n"
                          f"{report}")


ORIGINAL = '''\
"""The original module."""


def helper(x: int) -> int:
    """Double x for DenseFormer."""
    return 2 * x


class DenseFormerThing:
    """A class with a method and a nested class."""

    @staticmethod
    def method(value):
        """Return value + 1 (DenseFormer)."""
        return value + 1

    class Inner:
        """Nested."""

        size = 3
'''

COPY = '''\
"""A copy module in another family folder."""

DOCUMENTED = """
# Copied from depthfusion_hf.nowhere.at_all  (inside a string: not a marker)
"""


# Copied from depthfusion_hf.fam_a.original.helper with DenseFormer->MoDA
def helper(x: int) -> int:
    """Double x for MoDA."""
    return 2 * x


class MoDAThing:
    """Holds copies of a method and a nested class."""

    # Copied from depthfusion_hf.fam_a.original.DenseFormerThing.method with DenseFormer->MoDA
    @staticmethod
    def method(value):
        """Return value + 1 (MoDA)."""
        return value + 1

    # Copied from depthfusion_hf.fam_a.original.DenseFormerThing.Inner
    class Inner:
        """Nested."""

        size = 3

    def own(self):
        return "not a copy"
'''


def make_tree(tmp_path: Path, copy: str = COPY) -> tuple[Path, Path]:
    """A fake ``src/depthfusion_hf`` with an original module and a copy module; returns (src root, copy file)."""
    src = tmp_path / "src"
    for folder in ("fam_a", "fam_b"):
        (src / "depthfusion_hf" / folder).mkdir(parents=True)
    (src / "depthfusion_hf" / "fam_a" / "original.py").write_text(ORIGINAL)
    copy_path = src / "depthfusion_hf" / "fam_b" / "copy.py"
    copy_path.write_text(copy)
    return src, copy_path


def test_matching_copies_with_replacements_methods_and_nested_classes_pass(tmp_path):
    src, _ = make_tree(tmp_path)
    assert [target.rsplit(".", 2)[-2:] for _, _, target in list_markers(src)] == [
        ["original", "helper"], ["DenseFormerThing", "method"], ["DenseFormerThing", "Inner"]]
    assert check_copies(src) == []
    assert main(["--src", str(src)]) == 0


@pytest.mark.parametrize(
    ("old", "new", "marker_line"),
    [
        ("    return 2 * x\n", "    return 3 * x\n", 8),  # a function body
        ('        """Return value + 1 (MoDA)."""\n', '        """Return value + 2 (MoDA)."""\n', 17),  # a method
        ("    @staticmethod\n", "    @classmethod\n", 17),  # a decorator is part of the copy
        ("        size = 3\n", "        size = 4\n", 23),  # a nested class
    ],
    ids=["function", "method", "decorator", "nested-class"],
)
def test_a_drifted_copy_is_reported_and_fix_rewrites_it(tmp_path, old, new, marker_line):
    assert COPY.count(old) == 1
    src, copy_path = make_tree(tmp_path, COPY.replace(old, new))
    problems = check_copies(src)
    assert [(problem.path, problem.line) for problem in problems] == [(copy_path, marker_line)]
    assert "differs from its original" in str(problems[0]) and str(copy_path) in str(problems[0])
    diff_lines = [line[1:].strip() for line in problems[0].diff.splitlines()]
    assert old.strip() in diff_lines and new.strip() in diff_lines
    assert main(["--src", str(src)]) == 1
    assert main(["--src", str(src), "--fix"]) == 0
    assert copy_path.read_text() == COPY  # restored exactly, indentation and the rest of the file kept
    assert check_copies(src) == []


def test_a_copy_whose_replacement_is_missing_is_drift(tmp_path):
    src, copy_path = make_tree(tmp_path, COPY.replace(" with DenseFormer->MoDA\ndef helper", "\ndef helper"))
    problems = check_copies(src)
    assert len(problems) == 1 and "`helper` differs" in problems[0].message
    assert "+    \"\"\"Double x for MoDA.\"\"\"" in problems[0].diff


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("# Copied from depthfusion_hf.fam_a.original.missing", "has no definition 'missing'"),
        ("# Copied from depthfusion_hf.fam_c.nothing.helper", "no module file found"),
        ("# Copied from other_package.fam_a.original.helper", "must start with 'depthfusion_hf'"),
        ("# Copied from depthfusion_hf.fam_a.original.helper with DenseFormer", "bad replacement 'DenseFormer'"),
    ],
)
def test_unresolvable_markers_are_problems(tmp_path, marker, message):
    first_marker = "# Copied from depthfusion_hf.fam_a.original.helper with DenseFormer->MoDA"
    src, _ = make_tree(tmp_path, COPY.replace(first_marker, marker))
    problems = check_copies(src)
    assert len(problems) == 1 and "cannot resolve the marker" in problems[0].message and message in str(problems[0])
    assert not problems[0].fixable


def test_a_marker_not_directly_above_a_definition_is_a_problem(tmp_path):
    src, _ = make_tree(tmp_path, COPY.replace("DenseFormer->MoDA\ndef helper", "DenseFormer->MoDA\n\ndef helper"))
    problems = check_copies(src)
    assert len(problems) == 1 and "not directly above a def or class" in problems[0].message


def test_a_trailing_noqa_on_a_long_marker_is_not_a_replacement(tmp_path):
    first_marker = "# Copied from depthfusion_hf.fam_a.original.helper with DenseFormer->MoDA"
    src, _ = make_tree(tmp_path / "kept", COPY.replace(first_marker, first_marker + "  # noqa: E501"))
    assert len(list_markers(src)) == 3 and check_copies(src) == []
    no_with = "# Copied from depthfusion_hf.fam_a.original.helper  # noqa: E501"
    src, _ = make_tree(tmp_path / "no_with", COPY.replace(first_marker, no_with))
    assert len(check_copies(src)) == 1  # read as a marker without replacements: the MoDA copy then differs
    src, _ = make_tree(tmp_path / "more", COPY.replace(first_marker, first_marker + "  # noqa: E501, more"))
    assert len(check_copies(src)) == 1  # anything else after the replacements is still part of them


def test_replacements_are_parsed_and_applied_in_order():
    assert parse_replacements("DenseFormer->MoDA, denseformer->moda") == [("DenseFormer", "MoDA"),
                                                                        ("denseformer", "moda")]
    assert parse_replacements(None) == []
    assert apply_replacements("DenseFormerConfig denseformer", parse_replacements("DenseFormer->MoDA, MoDA->X")) == \
        "XConfig denseformer"
    with pytest.raises(ValueError, match="bad replacement"):
        parse_replacements("A->B->C")


def test_fix_handles_several_drifted_copies_in_one_file(tmp_path):
    drifted = COPY.replace("return 2 * x\n", "return 5 * x\n").replace("size = 3\n", "size = 9\n")
    src, copy_path = make_tree(tmp_path, drifted)
    assert len(check_copies(src)) == 2
    assert len(check_copies(src, fix=True)) == 2  # both reported, both fixed
    assert copy_path.read_text() == COPY


def test_a_marker_between_decorators_and_def_compares_from_the_def_line(tmp_path):
    marker = "    # Copied from depthfusion_hf.fam_a.original.DenseFormerThing.method with DenseFormer->MoDA\n"
    below = COPY.replace(marker + "    @staticmethod\n", "    @staticmethod\n" + marker)
    assert below != COPY
    src, copy_path = make_tree(tmp_path, below.replace("    @staticmethod\n", "    @some_other_decorator\n"))
    assert check_copies(src) == []  # decorators above the marker are not part of the copy
    drifted = below.replace("return value + 1\n", "return value - 1\n")
    copy_path.write_text(drifted)
    problems = check_copies(src)
    assert [problem.line for problem in problems] == [18]
    check_copies(src, fix=True)
    assert copy_path.read_text() == below


def test_a_file_that_does_not_parse_is_a_problem_not_a_crash(tmp_path):
    src, copy_path = make_tree(tmp_path, COPY + "\ndef broken(:\n")
    problems = check_copies(src)
    assert len(problems) == 1 and "cannot parse the file" in problems[0].message and problems[0].path == copy_path


def test_the_command_runs_from_the_repository_root_and_is_not_in_the_package(tmp_path):
    """``python utils/check_copies.py`` checks this checkout's src/ by default (the same verdict as the function on
    src/), exits 0 on matching copies and 1 on a drifted copy (``--src``); the runtime package no longer ships it."""
    run = subprocess.run([sys.executable, "utils/check_copies.py"], cwd=REPO, capture_output=True, text=True)
    problems = check_copies(SRC)
    assert run.returncode == (1 if problems else 0), run.stdout + run.stderr
    assert all(str(problem) in run.stdout for problem in problems)
    src, _ = make_tree(tmp_path / "clean")
    run = subprocess.run([sys.executable, "utils/check_copies.py", "--src", str(src)], cwd=REPO, capture_output=True,
                         text=True)
    assert run.returncode == 0 and "every marked copy matches its original" in run.stdout
    src, copy_path = make_tree(tmp_path, COPY.replace("    return 2 * x\n", "    return 3 * x\n"))
    run = subprocess.run([sys.executable, "utils/check_copies.py", "--src", str(src)], cwd=REPO, capture_output=True,
                         text=True)
    assert run.returncode == 1 and f"{copy_path}:8" in run.stdout
    run = subprocess.run([sys.executable, "utils/check_copies.py", "--src", str(tmp_path / "empty")], cwd=REPO,
                         capture_output=True, text=True)
    assert run.returncode == 2 and "holds no depthfusion_hf/" in run.stderr
    assert importlib.util.find_spec("depthfusion_hf.check_copies") is None
