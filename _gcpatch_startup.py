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


def bootstrap():
    """Activate gcpatch when GCPATCH asks for it. Idempotent (the .pth line can run twice in a
    venv whose lib64 links to lib) and never raises into the host."""
    if os.environ.get("GCPATCH", "").strip().lower() in _OFF:
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
