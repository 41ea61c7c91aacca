"""The layers of gcpatch/, read from the source (deferred imports inside functions count): no
module imports one of a higher layer, so there is no import circle, and no module reaches into
another's private names. The order is the one docs/LAYOUT.md describes; a new module names its
layer here. Modules of a subpackage are named with their package (`step.planner`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gcpatch"

# The first training step's package (gcpatch/step/): one room of the orchestration layer.
STEP_ORDER = (
    "step",
    "step.batch",
    "step.invisible",
    "step.training",
    "step.verify",
    "step.held",
    "step.bytes",
    "step.probe",
    "step.levers.lever",
    "step.levers.policy",
    "step.levers.whole",
    "step.levers.keep_matmuls",
    "step.levers.keep_attention",
    "step.levers.feed_forward",
    "step.levers.offload",
    "step.levers",
    "step.solver",
    "step.cost_model",
    "step.outcome",
    "step.plan_lines",
    "step.receipts",
    "step.shapes",
    "step.planner",
    "step.first_step",
)
STEP = set(STEP_ORDER)
# Lowest first. A module may import its own layer or any layer below it.
LAYERS = (
    (
        "vocabulary",
        {
            "errors",
            "schema",
            "value_class",
            "settings",
            "lifetime",
            "call",
            "call.caller",
            "import_hooks",
            "release_range",
            "headline",
            "hookspecs",
            "budget",
        },
    ),
    ("facts", {"ranks", "facts", "call.call_facts", "context"}),
    ("rules", {"resolve"}),
    (
        "effects",
        {
            "apply",
            "call.call_rewrites",
            "call.curried_call",
            "console",
            "nofollow",
            "record",
            "crash_notes",
            "call.reentrant_grads",
            "mrope_mask",
        },
    ),
    ("plugin runtime", {"patching", "deadline", "plugin_scan", "manager", "engine"}),
    ("orchestration", {"call.checkpoint_call", "verify", "pipeline", "agreement"} | STEP),
    (
        "switch and surfaces",
        {
            "activation",
            "__init__",
            "plugin",
            "commands",
            "commands.cli",
            "commands.doctor",
            "commands.explain",
            "__main__",
        },
    ),
)


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name inside it ("__init__" for the package)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _target(base: str, name: str | None, modules: set[str]) -> str | None:
    """The gcpatch module an import names: `from <base> import <name>` or `import <base>`."""
    if base == "gcpatch":
        if name is None:
            return "__init__"
        return name if name in modules else "__init__"
    if not base.startswith("gcpatch."):
        return None
    inner = base[len("gcpatch.") :]
    if name is not None and f"{inner}.{name}" in modules:
        return f"{inner}.{name}"
    while inner and inner not in modules:
        inner = inner.rpartition(".")[0]
    return inner or None


def _imports_of(path: Path, modules: set[str]) -> tuple[set[str], dict[str, str]]:
    """(the gcpatch modules `path` imports, the local names bound to gcpatch modules)."""
    out: set[str] = set()
    bound: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                target = _target(node.module, alias.name, modules)
                if target is not None:
                    out.add(target)
                    if target.rpartition(".")[2] == alias.name or target == alias.name:
                        bound[alias.asname or alias.name] = target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = _target(alias.name, None, modules)
                if target is not None:
                    out.add(target)
                    if alias.asname:
                        bound[alias.asname] = target
    return out, bound


def imports() -> dict[str, set[str]]:
    """module -> the gcpatch modules it imports anywhere in its source."""
    names = module_names()
    return {name: _imports_of(path, set(names))[0] - {name} for name, path in names.items()}


def private_uses(package: Path = PACKAGE) -> list[str]:
    """`module._name` across modules: a private name of one gcpatch module read in another (by
    attribute, or imported by name)."""
    names = module_names(package)
    found = []
    for name, path in names.items():
        _, bound = _imports_of(path, set(names))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("gcpatch")
            ):
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and _target(node.module, alias.name, set(names)) != name:
                        found.append(f"{name} imports {node.module}.{alias.name}")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner = bound.get(node.value.id)
                attr = node.attr
                if owner and owner != name and attr.startswith("_") and not attr.startswith("__"):
                    found.append(f"{name} reads {owner}.{attr}")
    return sorted(set(found))


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


def test_no_module_reads_another_modules_private_names():
    assert private_uses() == []


def test_the_private_name_finder_finds_one(tmp_path):
    package = tmp_path / "gcpatch"
    (package / "step").mkdir(parents=True)
    (package / "a.py").write_text("_flag = 1\n")
    (package / "step" / "__init__.py").write_text("")
    (package / "step" / "b.py").write_text("from gcpatch import a\nx = a._flag\n")
    (package / "step" / "c.py").write_text("from gcpatch.a import _flag\n")
    assert private_uses(package) == ["step.b reads a._flag", "step.c imports gcpatch.a._flag"]


def test_docs_layout_names_every_module_in_its_layer():
    text = (PACKAGE.parent / "docs" / "LAYOUT.md").read_text(encoding="utf-8")
    items = re.findall(r"^\d+\. \*\*([a-z ]+)\*\*:(.*?)(?=^\d+\. \*\*|^$)", text, re.M | re.S)
    documented = {layer: set(re.findall(r"`([a-z_.]+)`", body)) for layer, body in items}
    assert {
        layer: names - documented.get(layer, set())
        for layer, names in LAYERS
        if names - documented.get(layer, set())
    } == {}


def test_the_step_packages_map_lists_its_modules_in_the_order_data_flows():
    """gcpatch/step/__init__.py's list is the layer table's, module for module and in order."""
    doc = (PACKAGE / "step" / "__init__.py").read_text()
    listed = ["step." + name for name in re.findall(r"^- `([\w.]+)`", doc, re.M)]
    order = [name for name in STEP_ORDER if name != "step"]
    assert listed == order
    graph = imports()
    later = {
        name: sorted(set(graph.get(name, ())) & set(order[i + 1 :])) for i, name in enumerate(order)
    }
    assert {name: found for name, found in later.items() if found} == {}  # data flows down
