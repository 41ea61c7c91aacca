"""gcpatch/plugin.py is the public plugin API: its `__all__` is pinned here (a change to it is a
change to what third-party plugins may rely on), every exported name says what it is for, and the
built-in plugins and the example import gcpatch through it alone, but for the internals that
`BUILTIN_ONLY` names."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import gcpatch.plugin as api

ROOT = Path(__file__).resolve().parents[2]

PINNED = [
    "CRASH",
    "EVAL_MODE_FIX",
    "GRAD_INPUT",
    "INPUT_GRADS_HOOK",
    "LIFT_BOUND_TENSORS",
    "NO_MEMORY_SAVED",
    "RECOMMENDED",
    "REQUIRED",
    "RUN_INLINE",
    "TUPLE_OUTPUTS",
    "USE_CACHE_OFF",
    "USE_REENTRANT",
    "WRONG_GRADIENTS",
    "ZERO3_NONREENTRANT_RECOMPUTE",
    "CallFacts",
    "Decision",
    "EnableCall",
    "Facts",
    "Failure",
    "GcpatchError",
    "Knob",
    "PatchPoint",
    "PluginInfo",
    "Rule",
    "Source",
    "Stack",
    "Stage",
    "Strength",
    "Vote",
    "asking",
    "for_config",
    "hookimpl",
    "installed_version",
    "redecide",
    "redecide_within",
    "run_config",
    "run_disable",
    "run_enable",
]


def test_all_is_pinned():
    assert api.__all__ == PINNED


def test_every_exported_name_is_there_and_documented():
    undocumented = []
    for name in api.__all__:
        obj = getattr(api, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            documented = bool(obj.__doc__ and obj.__doc__.strip())
        elif isinstance(obj, str):  # a word of the vocabulary: named in the module's docstring
            documented = name in api.__doc__
        else:  # hookimpl: pluggy's marker
            documented = f"`@{name}`" in api.__doc__
        if not documented:
            undocumented.append(name)
    assert undocumented == []


def _gcpatch_imports(path: Path) -> set[str]:
    """The gcpatch modules `path` imports from (a `from gcpatch import x` names module gcpatch.x,
    a `from gcpatch.call import x` module gcpatch.call.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "gcpatch":
            found |= {f"gcpatch.{a.name}" for a in node.names}
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gcpatch.")
        ):
            package = ROOT.joinpath(*node.module.split("."))
            if package.is_dir():
                found |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gcpatch.")}
    return found


def test_built_in_plugins_import_the_api_or_a_listed_internal():
    allowed = {"gcpatch.plugin", *api.BUILTIN_ONLY}
    beyond = {
        p.name: sorted(_gcpatch_imports(p) - allowed)
        for p in sorted((ROOT / "plugins").glob("*.py"))
    }
    assert {name: mods for name, mods in beyond.items() if mods} == {}
    used = set().union(*(_gcpatch_imports(p) for p in (ROOT / "plugins").glob("*.py")))
    assert set(api.BUILTIN_ONLY) <= used, (
        "an internal no built-in plugin needs any more: drop it from BUILTIN_ONLY"
    )


def test_the_example_plugin_needs_the_api_alone():
    assert _gcpatch_imports(
        ROOT / "examples" / "gcpatch-acme" / "gcpatch_acme" / "__init__.py"
    ) == {"gcpatch.plugin"}
