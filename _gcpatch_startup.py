"""Interpreter start-up hook of gcpatch (gcpatch.pth, and gcpatch.start on Python >= 3.15), and
the import watcher that starts gcpatch when the first framework is imported.

Kept outside the gcpatch package: with GCPATCH=1 the start-up path loads this one small module
and installs the watcher; the package itself loads only when a framework is first imported
(PEP 829 imports the module of every .start entry, so nothing here may import gcpatch early).

PYTEST_DONT_REWRITE: pytest marks every top-level module of a distribution with a pytest11 entry
point for assertion rewriting and warns (PytestAssertRewriteWarning, an error under `-W error`)
for one already imported, as this one is by the .pth line. It holds no test helpers to rewrite.
"""

import os
import sys

# The packages whose first import starts gcpatch. torch is one: a hand-written model meets gcpatch
# only at the checkpoint call (CK1-CK3). Third-party plugins are loaded then too.
TRIGGERS = frozenset(
    {"torch", "transformers", "peft", "trl", "axolotl", "colossalai", "accelerate", "deepspeed"}
)
_OFF = ("", "0", "false", "no", "off")
# Variables of gcpatch's own test and CI tools (.ci/run, tests/kit, matrix/run.py): the library
# reads none of them, and says nothing of them.
TOOLING = (
    "GCPATCH_CI_",
    "GCPATCH_TEST_",
    "GCPATCH_IT_",
    "GCPATCH_PY",
    "GCPATCH_MATRIX_",
    "GCPATCH_TORCH_BASE",
    "GCPATCH_HYPOTHESIS",
    "GCPATCH_RELIABILITY_",
    "GCPATCH_FULL_GRID",
    "GCPATCH_GRID_",
)


class FrameworkWatcher:
    """A `sys.meta_path` finder that waits for the first import of a trigger package.

    It never finds anything itself: when a trigger is looked up it removes itself, runs its
    callback (which starts gcpatch's engine and its post-import hooks) and hands the lookup back
    to the import system.
    """

    def __init__(self, on_first_import):
        self._on_first_import = on_first_import

    def find_spec(self, fullname, path=None, target=None):
        if path is not None or fullname not in TRIGGERS:
            return None
        unwatch()
        self._on_first_import()
        import importlib.util  # only now: a framework is being imported anyway

        return importlib.util.find_spec(fullname)

    def __repr__(self):
        return "<gcpatch framework watcher>"


def watch(on_first_import):
    """Call `on_first_import` once, when the first trigger package is imported (at once if one
    already is). Idempotent: one watcher at most."""
    if any(name in sys.modules for name in TRIGGERS):
        on_first_import()
    elif not any(isinstance(f, FrameworkWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, FrameworkWatcher(on_first_import))


def unwatch():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, FrameworkWatcher)]


def set_variables():
    """The GCPATCH_* variables (GCPATCH itself and the tools' own aside) set in this process."""
    return sorted(
        name for name in os.environ if name.startswith("GCPATCH_") and not name.startswith(TOOLING)
    )


class UnusedWatcher:
    """Waits, like FrameworkWatcher, for the first framework import of a process where GCPATCH is
    unset, to say once that its GCPATCH_* variables do nothing (unless gcpatch was imported since:
    `import gcpatch` sets GCPATCH). GCPATCH=0 switched gcpatch off on purpose: nothing is said."""

    def find_spec(self, fullname, path=None, target=None):
        if path is not None or fullname not in TRIGGERS:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, UnusedWatcher)]
        names = set_variables()
        if names and "GCPATCH" not in os.environ and _local_rank_zero():
            verbs = "are set but do" if len(names) > 1 else "is set but does"
            sys.stderr.write(
                f"gcpatch: {', '.join(names)} {verbs} nothing: gcpatch is off (GCPATCH unset); set"
                " GCPATCH=1 or `import gcpatch`\n"
            )
        return None

    def __repr__(self):
        return "<gcpatch unused-variables watcher>"


def _local_rank_zero():
    return os.environ.get("LOCAL_RANK", "0").strip() in ("", "0")


def bootstrap():
    """Activate gcpatch when GCPATCH asks for it. Idempotent (the .pth line can run twice in a
    venv whose lib64 links to lib) and never raises into the host. Unset, with GCPATCH_*
    variables set: one line at the first framework import says they do nothing."""
    if os.environ.get("GCPATCH", "").strip().lower() in _OFF:
        unset = "GCPATCH" not in os.environ
        if (
            unset
            and set_variables()
            and not any(isinstance(f, UnusedWatcher) for f in sys.meta_path)
        ):
            sys.meta_path.insert(0, UnusedWatcher())
        return
    try:
        watch(_import_gcpatch)
    except Exception as exc:  # noqa: BLE001
        _failed(exc)


def _import_gcpatch():
    try:
        from gcpatch import activation  # importing the package activates it
    except Exception as exc:  # noqa: BLE001
        _failed(exc)
        return
    activation.framework_imported()  # fails open by itself; strict mode raises on purpose


def _failed(exc):
    sys.stderr.write(
        f"gcpatch: start-up hook failed, continuing without it ({type(exc).__name__}: {exc})\n"
    )
