"""Every piece of module-level state in gcpatch/ has an owner and a lifetime: read from the source,
each mutable module-level name (and each name a function declares `global`) is listed here as
living as long as the process, as long as an activation (its module registers a reset with
gcpatch/lifetime.py, which `engine.stop()` runs), or as a read-only table. An unlisted name fails:
state added without saying when it ends is how `deactivate(); activate()` came to reuse stale
outcomes, plans and verified models."""

from __future__ import annotations

import ast
import importlib
import weakref
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gcpatch"

# Lives as long as the process, and why that is right.
PROCESS = {
    "activation._active": "the switch itself (activate / deactivate set it)",
    "call.caller._trampolines": "code objects per call site: a cache that changes no behaviour",
    "call.call_facts._PLAIN_KINDS": "classes defining no function attributes: a fact of the class",
    "call.checkpoint_call._torch": "torch's module, bound at the first call",
    "call.checkpoint_call._depth": "a context variable: set inside a checkpointed function, reset after",
    "context._asker": "a context variable: set for one enable call, reset after",
    "facts._walk": "a context variable: one module walk per decision",
    "engine._loading": "the lock around loading the plugins",
    "import_hooks._hooks": "hooks waiting for their module's import: a patch point armed in one"
    " activation and imported after it ended is not installed (the patcher it belongs to stopped)",
    "import_hooks._lock": "the lock around the waiting hooks",
    "lifetime._resets": "the registry of resets itself",
    "manager._said": "what this process said about plugin ranges: a release does not change",
    "mrope_mask._names": "a forward's parameter names per class: a fact of the class",
    "context._own_passes": "gcpatch's own passes in progress: back to 0 when each ends",
    "step.levers._registry": "the budget's levers, registered at import (or by a plugin): a"
    " vocabulary, not a decision",
}
# Owned by engine.stop() itself (it ends the activation).
ENGINE = {"engine._host", "engine._patcher", "engine._starting"}
# Lives as long as one activation: the module's registered reset ends it.
ACTIVATION = {
    "agreement._rounds",
    "apply._states",
    "call.checkpoint_call._covered",
    "call.checkpoint_call._outcomes",
    "call.checkpoint_call._reported_sites",
    "call.checkpoint_call._probed",
    "call.checkpoint_call._untracked",
    "console._said",
    "console._seen",
    "console._mine",
    "console._pending",
    "context._models",
    "context._instances",
    "crash_notes._installed",
    "call.curried_call._clashes_said",
    "mrope_mask._said",
    "record._history",
    "record._last_of",
    "record._unwritable",
    "call.reentrant_grads._seen",
    "call.reentrant_grads._said",
    "settings._reported",
    "step.first_step._armed",
    "step.shapes._plans",
}
# Tables that are never written after import.
CONSTANT = {
    "__init__.__all__",
    "budget._UNITS",
    "commands.explain._CALL_FIELDS",
    "commands.explain._DECISION_FIELDS",
    "commands.explain._DETAIL_FIELDS",
    "headline._KNOB_WORDS",
    "manager._VALUE_TYPES",
    "pipeline.__all__",
    "plugin.BUILTIN_ONLY",
    "plugin.__all__",
    "resolve.TIE_VALUES",
    "schema.FAILURE_ORDER",
    "schema.STRENGTH_ORDER",
    "step.verify.RTOL",
    "verify.__all__",
}
_MUTABLE_CALLS = (
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
    "ContextVar",
    "RLock",
    "Lock",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def state_names() -> set[str]:
    """module.name for every module-level mutable value and every `global` name of gcpatch/."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign) and node.value is not None
                else []
            )
            value = getattr(node, "value", None)
            mutable = isinstance(
                value, (ast.Dict, ast.Set, ast.List, ast.DictComp, ast.ListComp, ast.SetComp)
            ) or (
                isinstance(value, ast.Call)
                and ast.unparse(value.func).rsplit(".", 1)[-1]
                in (*_MUTABLE_CALLS, "dict", "set", "list")
            )
            if mutable:
                found |= {f"{module}.{ast.unparse(t)}" for t in targets}
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found |= {f"{module}.{name}" for name in node.names}
    return found


def test_every_piece_of_state_has_a_listed_lifetime():
    listed = set(PROCESS) | ENGINE | ACTIVATION | CONSTANT
    assert state_names() - listed == set(), "list the new state here with its lifetime"
    assert listed - state_names() == set(), "a listed name no longer exists: take it out"


@pytest.mark.parametrize("name", sorted(ACTIVATION))
def test_each_activation_state_is_ended_by_its_modules_registered_reset(name):
    module_name, attr = name.rsplit(".", 1)
    module = importlib.import_module(f"gcpatch.{module_name}")
    from gcpatch import lifetime

    assert f"gcpatch.{module_name}" in lifetime.registered(), (
        f"gcpatch.{module_name} holds activation state but registers no reset"
    )
    value = getattr(module, attr)
    if isinstance(value, list) and value and isinstance(value[0], bool):
        value[0] = True  # a flag in a list (reentrant_grads._seen)
        lifetime.reset_all()
        assert getattr(module, attr) == [False]
        return
    key = _Key()
    if isinstance(value, (set, weakref.WeakSet)):
        value.add(key)
    elif isinstance(value, list):
        value.append(("probe",))
    else:
        value[key] = 1
    assert len(value) > 0
    lifetime.reset_all()
    assert len(getattr(module, attr)) == 0, name


class _Key:
    """A hashable, weak-referenceable key no reset knows."""
