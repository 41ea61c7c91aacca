"""The layers of gcpatch/, read from the source (deferred imports inside functions count): no
module imports one of a higher layer, so there is no import circle. The order is the one
docs/LAYOUT.md describes; a new module names its layer here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gcpatch"

# Lowest first. A module may import its own layer or any layer below it.
LAYERS = (
    ("vocabulary", {"errors", "schema", "settings", "caller", "headline", "hookspecs", "budget"}),
    ("facts", {"ranks", "facts", "call_facts", "context"}),
    ("rules", {"resolve"}),
    ("effects", {"apply", "call_rewrites", "console", "record", "crash_notes", "reentrant_grads"}),
    ("plugin runtime", {"patching", "manager", "engine"}),
    (
        "orchestration",
        {"checkpoint_call", "verify", "layer_costs", "planner", "pipeline", "agreement"},
    ),
    ("switch and surfaces", {"activation", "__init__", "plugin", "cli", "__main__"}),
)


def imports() -> dict[str, set[str]]:
    """module -> the gcpatch modules it imports anywhere in its source."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    found: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = (
                    f"gcpatch.{node.module}"
                    if node.level and node.module
                    else "gcpatch"
                    if node.level
                    else node.module
                )
                if base == "gcpatch":
                    out |= {a.name if a.name in modules else "__init__" for a in node.names}
                elif base and base.startswith("gcpatch."):
                    out.add(base.split(".")[1])
            elif isinstance(node, ast.Import):
                out |= {
                    a.name.split(".")[1] if "." in a.name else "__init__"
                    for a in node.names
                    if a.name.split(".")[0] == "gcpatch"
                }
        found[path.stem] = out - {path.stem}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_inside_gcpatch():
    assert cycles(imports()) == []


def test_the_circle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_has_a_layer():
    layered = set().union(*(names for _, names in LAYERS))
    assert set(imports()) - layered == set(), "add the new module to LAYERS (and docs/LAYOUT.md)"


def test_no_module_imports_a_higher_layer():
    level = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
    upward = sorted(
        f"{m} ({LAYERS[level[m]][0]}) imports {d} ({LAYERS[level[d]][0]})"
        for m, deps in imports().items()
        for d in deps
        if m in level and d in level and level[d] > level[m]
    )
    assert upward == []


def test_docs_layout_names_every_module_in_its_layer():
    text = (PACKAGE.parent / "docs" / "LAYOUT.md").read_text(encoding="utf-8")
    items = re.findall(r"^\d+\. \*\*([a-z ]+)\*\*:(.*?)(?=^\d+\. \*\*|^$)", text, re.M | re.S)
    documented = {layer: set(re.findall(r"`([a-z_]+)`", body)) for layer, body in items}
    assert {
        layer: names - documented.get(layer, set())
        for layer, names in LAYERS
        if names - documented.get(layer, set())
    } == {}
