"""Check (and fix) the code copied across model-family folders, transformers-style.

Each family folder is self-contained (``save_pretrained`` copies it for remote code), so a few functions
and classes are repeated in several folders. Every repeat carries a marker on the line directly above its
``def`` / ``class`` (above its decorators, if any), naming the original by its dotted path::

    # Copied from depthfusion_hf.models.configuration_denseformer.check_llama_shapes
    # Copied from depthfusion_hf.models.modeling_denseformer.DenseFormerModel.forward with DenseFormer->MoDA

The path is a module under ``depthfusion_hf`` followed by the object's qualified name (``Class``,
``function``, ``Class.method``, ``Outer.Inner``). ``with A->B, C->D`` lists plain string replacements
applied, in order, to the original's source before comparing (a marker longer than the line limit ends with
``  # noqa: E501``, which is not part of them). A copy matches when its source (decorators
included, dedented, trailing whitespace ignored) equals the original's after replacement.

This is a development tool, not part of the package (standard library only): ``python utils/check_copies.py
[--fix] [--diff]`` from the repository root and ``tests/test_copies.py`` run it over ``src/``; it never imports
the checked code.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "depthfusion_hf"
# A marker over the line-length limit may end with a noqa comment for E501 (not part of the replacements).
MARKER = re.compile(
    r"^(?P<indent>[ \t]*)# Copied from (?P<target>[\w.]+)(?: with (?P<replace>.+?))?(?:\s+# noqa: E501)?\s*$"
)
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True)
class Problem:
    """One marked copy that fails the check.

    Attributes:
        path: the file holding the marker.
        line: the marker's 1-based line number.
        target: the dotted path the marker names.
        message: what is wrong (drifted, original not found, marker not above a definition, ...).
        diff: for a drifted copy, a unified diff from the expected text to the copy ("" otherwise).
        fixable: True when ``fix`` can rewrite the copy (it drifted; the original was found).
    """

    path: Path
    line: int
    target: str
    message: str
    diff: str = ""
    fixable: bool = False

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.target}: {self.message}"


def parse_replacements(text: str | None) -> list[tuple[str, str]]:
    """``"A->B, C->D"`` -> ``[("A", "B"), ("C", "D")]``; ValueError for an item without exactly one ``->``."""
    if not text:
        return []
    pairs = []
    for item in text.split(", "):
        parts = item.split("->")
        if len(parts) != 2 or not parts[0]:
            raise ValueError(f"bad replacement {item!r}; expected 'old->new' items separated by ', '")
        pairs.append((parts[0].strip(), parts[1].strip()))
    return pairs


def apply_replacements(code: str, replacements: list[tuple[str, str]]) -> str:
    """``code`` with each ``(old, new)`` applied in order with ``str.replace``."""
    for old, new in replacements:
        code = code.replace(old, new)
    return code


def _start_line(node: ast.AST) -> int:
    """1-based first line of a definition, its decorators included."""
    return min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])


def _definitions(tree: ast.AST) -> list[ast.AST]:
    """Every function and class definition in ``tree``, nested ones included."""
    return [node for node in ast.walk(tree) if isinstance(node, _DEFINITIONS)]


def _first_line(node: ast.AST, with_decorators: bool) -> int:
    return _start_line(node) if with_decorators else node.lineno


def _block(lines: list[str], node: ast.AST, with_decorators: bool = True) -> str:
    """The definition's source (decorators included unless told), dedented, trailing whitespace removed."""
    text = "".join(lines[_first_line(node, with_decorators) - 1 : node.end_lineno])
    return "\n".join(line.rstrip() for line in textwrap.dedent(text).splitlines()) + "\n"


def find_object(src_root: Path, target: str) -> tuple[Path, list[str], ast.AST]:
    """Locate ``target`` (``depthfusion_hf.<module path>.<qualified name>``) under ``src_root``.

    The module is the longest prefix that is a ``.py`` file; the rest is walked through nested class and
    function bodies. Returns (file, its lines, the definition node). Raises LookupError naming what is
    missing.
    """
    parts = target.split(".")
    if parts[0] != PACKAGE:
        raise LookupError(f"the path must start with {PACKAGE!r}")
    for split in range(len(parts) - 1, 0, -1):
        module = src_root.joinpath(*parts[:split]).with_suffix(".py")
        if module.is_file():
            break
    else:
        raise LookupError("no module file found for any prefix of the path")
    source = module.read_text(encoding="utf-8")
    body = ast.parse(source, filename=str(module)).body
    node = None
    for name in parts[split:]:
        node = next((n for n in body if isinstance(n, _DEFINITIONS) and n.name == name), None)
        if node is None:
            raise LookupError(f"{module} has no definition {name!r} on the path {'.'.join(parts[split:])}")
        body = node.body
    return module, source.splitlines(keepends=True), node


def _marker_lines(source: str) -> list[tuple[int, str]]:
    """(line number, line) of each comment-only line that is a marker; text inside strings is not a comment."""
    found = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT and not token.line[: token.start[1]].strip() and MARKER.match(token.line):
                found.append((token.start[0], token.line))
    except (tokenize.TokenError, SyntaxError):
        pass  # a file that does not tokenize is reported by _check_file (it does not parse either)
    return found


def list_markers(src_root: str | Path) -> list[tuple[Path, int, str]]:
    """(file, line, target) of every ``# Copied from`` marker in the ``.py`` files under ``src_root``."""
    found = []
    for path in _python_files(Path(src_root)):
        for number, line in _marker_lines(path.read_text(encoding="utf-8")):
            found.append((path, number, MARKER.match(line).group("target")))
    return found


def _python_files(src_root: Path) -> list[Path]:
    return sorted(path for path in src_root.rglob("*.py") if "__pycache__" not in path.parts)


def _check_file(path: Path, src_root: Path) -> list[tuple[Problem, tuple[ast.AST, bool] | None, str]]:
    """Every marker in ``path``, each as (problem or None when the copy matches, (copy node, whether the copy
    starts at its decorators), expected text).

    A marker may stand above a definition's decorators (they are then part of the copy) or between its
    decorators and the ``def`` / ``class`` line (they are then left out on both sides).
    """
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as error:
        return [(Problem(path, error.lineno or 0, "", f"cannot parse the file: {error.msg}"), None, "")]
    starts: dict[int, tuple[ast.AST, bool]] = {}
    for node in _definitions(tree):
        starts.setdefault(_start_line(node), (node, True))
        starts.setdefault(node.lineno, (node, False))
    results = []
    for number, line in _marker_lines(source):
        match = MARKER.match(line)
        target = match.group("target")
        copy = starts.get(number + 1)
        if copy is None:
            results.append((Problem(path, number, target, "the marker is not directly above a def or class"), None,
                            ""))
            continue
        node, with_decorators = copy
        try:
            replacements = parse_replacements(match.group("replace"))
            _, original_lines, original = find_object(src_root, target)
        except (LookupError, ValueError, SyntaxError) as error:
            results.append((Problem(path, number, target, f"cannot resolve the marker: {error}"), None, ""))
            continue
        expected = apply_replacements(_block(original_lines, original, with_decorators), replacements)
        actual = _block(lines, node, with_decorators)
        if actual == expected:
            results.append((None, copy, expected))
            continue
        diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), actual.splitlines(keepends=True),
                                            f"{target} (expected)", f"{path}:{number + 1}"))
        message = f"the copy of `{node.name}` differs from its original"
        results.append((Problem(path, number, target, message, diff, fixable=True), copy, expected))
    return results


def _rewrite(path: Path, fixes: list[tuple[tuple[ast.AST, bool], str]]) -> None:
    """Replace each copy's lines by the expected text, indented like the copy (bottom-up)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for (node, with_decorators), expected in sorted(fixes, key=lambda item: item[0][0].lineno, reverse=True):
        first_line = _first_line(node, with_decorators)
        first = lines[first_line - 1]
        indent = first[: len(first) - len(first.lstrip())]
        new = [(indent + line if line.strip() else line) for line in expected.splitlines(keepends=True)]
        lines[first_line - 1 : node.end_lineno] = new
    path.write_text("".join(lines), encoding="utf-8")


def check_copies(src_root: str | Path, fix: bool = False) -> list[Problem]:
    """Check every ``# Copied from`` marker in the ``.py`` files under ``src_root`` (the folder holding
    ``depthfusion_hf/``); with ``fix``, rewrite drifted copies from their originals.

    Returns the problems found (drifted copies are reported even when fixed, so a caller can list them).
    A copy whose original is itself a fixed copy may need a second run; ``fix`` repeats until stable.
    """
    src_root = Path(src_root)
    files = _python_files(src_root)
    reported: list[Problem] = []
    for _ in range(5 if fix else 1):
        changed = False
        for path in files:
            results = _check_file(path, src_root)
            reported.extend(p for p, _, _ in results if p is not None and p not in reported)
            fixes = [(node, expected) for problem, node, expected in results if problem is not None and problem.fixable]
            if fix and fixes:
                _rewrite(path, fixes)
                changed = True
        if not changed:
            break
    return reported


def main(argv: list[str] | None = None) -> int:
    """Command line: exit 1 listing each drifted or unresolvable copy (0 when all match, or all were fixed)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"),
                        help="the folder holding depthfusion_hf/ (default: this checkout's src/)")
    parser.add_argument("--fix", action="store_true", help="rewrite drifted copies from their originals")
    parser.add_argument("--diff", action="store_true", help="print a diff for each drifted copy")
    args = parser.parse_args(argv)
    if not (Path(args.src) / PACKAGE).is_dir():
        parser.error(f"--src {args.src} holds no {PACKAGE}/ folder")
    problems = check_copies(args.src, fix=args.fix)
    for problem in problems:
        print(problem)
        if args.diff and problem.diff:
            print(problem.diff)
    remaining = check_copies(args.src) if args.fix else problems
    if args.fix:
        fixed = len(problems) - len(remaining)
        print(f"fixed {fixed} cop{'y' if fixed == 1 else 'ies'}; {len(remaining)} problem(s) left")
    elif not problems:
        print("every marked copy matches its original")
    return 1 if remaining else 0


__all__ = [
    "MARKER",
    "Problem",
    "apply_replacements",
    "check_copies",
    "find_object",
    "list_markers",
    "main",
    "parse_replacements",
]


if __name__ == "__main__":
    raise SystemExit(main())
