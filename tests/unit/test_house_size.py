"""The package stays readable, read from the source: no function in gcpatch/ or plugins/ longer than
a screen (80 lines), docstrings that say a contract rather than a history (at most two longer than
15 lines), and at most 32 modules at the top of gcpatch/ (a new job goes into a subpackage)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "gcpatch", ROOT / "plugins")
MAX_FUNCTION_LINES = 80
MAX_DOCSTRING_LINES = 15
LONG_DOCSTRINGS_ALLOWED = 2
MAX_TOP_LEVEL_MODULES = 32


def _trees() -> list[tuple[str, ast.Module]]:
    return [
        (str(path.relative_to(ROOT)), ast.parse(path.read_text(encoding="utf-8")))
        for source in SOURCES
        for path in sorted(source.rglob("*.py"))
    ]


def long_functions() -> list[str]:
    """`path:name (lines)` for every function over MAX_FUNCTION_LINES, decorators left out."""
    return [
        f"{path}:{node.name} ({node.end_lineno - node.lineno + 1})"
        for path, tree in _trees()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def long_docstrings() -> list[str]:
    """`path:owner (lines)` for every module, class or function docstring over
    MAX_DOCSTRING_LINES."""
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if not isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            ):
                continue
            lines = len((ast.get_docstring(node) or "").splitlines())
            if lines > MAX_DOCSTRING_LINES:
                found.append(f"{path}:{getattr(node, 'name', '<module>')} ({lines})")
    return found


def top_level_modules() -> list[str]:
    return sorted(path.name for path in (ROOT / "gcpatch").glob("*.py"))


def test_no_function_is_longer_than_a_screen():
    assert long_functions() == [], "split it into named steps"


def test_docstrings_are_contracts_not_histories():
    found = long_docstrings()
    assert len(found) <= LONG_DOCSTRINGS_ALLOWED, found


def test_the_top_of_the_package_stays_small():
    modules = top_level_modules()
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules


def test_the_function_counter_counts_a_long_one(tmp_path, monkeypatch):
    package = tmp_path / "gcpatch"
    package.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    docstring = "\n".join(["a line"] * (MAX_DOCSTRING_LINES + 1))
    (package / "a.py").write_text(f'"""{docstring}"""\n\n\ndef long():\n{body}')
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    monkeypatch.setattr(f"{__name__}.SOURCES", (package,))
    assert long_functions() == [f"gcpatch/a.py:long ({MAX_FUNCTION_LINES + 1})"]
    assert long_docstrings() == ["gcpatch/a.py:<module> (16)"]
    assert top_level_modules() == ["a.py"]
