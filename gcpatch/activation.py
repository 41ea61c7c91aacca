"""Switching gcpatch on and off: a light import watcher that starts the engine lazily.

This module is on every interpreter's start-up path when GCPATCH=1, so it imports nothing
beyond what Python has already loaded: the engine (wrapt, pluggy, entry points) starts only
when the first framework package is imported (issue #3, design card: never import them).
"""
from __future__ import annotations

import os
import sys

from gcpatch import settings

# The packages whose first import starts the engine. Third-party plugins are loaded then too.
# torch is one: a hand-written model meets gcpatch only at the checkpoint call (CK1-CK3).
TRIGGERS = frozenset({"torch", "transformers", "peft", "trl", "axolotl", "colossalai", "accelerate", "deepspeed"})

_active = False
# GCPATCH as the process found it, before activate() set it for children (for `gcpatch doctor`).
ENV_AT_START = os.environ.get("GCPATCH")


class _FrameworkWatcher:
    """A `sys.meta_path` finder that waits for the first import of a trigger package.

    It never finds anything itself: when a trigger is looked up it starts the engine (which
    installs its own post-import hooks) and hands the lookup back to the import system.
    """

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: ANN001 (import protocol)
        if path is not None or fullname not in TRIGGERS:
            return None
        _remove_watcher()
        _start_engine()
        import importlib.util  # only now: a framework is being imported anyway

        return importlib.util.find_spec(fullname)

    def __repr__(self) -> str:
        return "<gcpatch framework watcher>"


_WATCHER = _FrameworkWatcher()


def activate() -> bool:
    """Turn gcpatch on for this process and its children. Idempotent; never raises.

    Returns False when GCPATCH=0 or GCPATCH_MODE=off asked for nothing to be patched.
    """
    global _active
    try:
        if settings.env_switch() is False or settings.read().mode == "off":
            return False
        if _active:
            return True
        _active = True
        # Children (subprocess, torchrun/accelerate/deepspeed ranks) start through the .pth line.
        os.environ.setdefault("GCPATCH", "1")
        if any(name in sys.modules for name in TRIGGERS):
            _start_engine()
        elif _WATCHER not in sys.meta_path:
            sys.meta_path.insert(0, _WATCHER)
        return True
    except Exception as exc:  # fail open: gcpatch must never break the host's start-up
        sys.stderr.write(f"gcpatch: not activated ({type(exc).__name__}: {exc})\n")
        return False


def deactivate() -> None:
    """Remove the watcher and every installed patch, restoring the originals."""
    global _active
    _active = False
    _remove_watcher()
    if "gcpatch.engine" in sys.modules:
        sys.modules["gcpatch.engine"].stop()


def is_active() -> bool:
    return _active


def _remove_watcher() -> None:
    while _WATCHER in sys.meta_path:
        sys.meta_path.remove(_WATCHER)


def _start_engine() -> None:
    try:
        from gcpatch import engine

        engine.start()
    except Exception as exc:  # fail open (issue #3 item 9): one line, original behaviour
        if settings.read().strict:
            raise
        sys.stderr.write(f"gcpatch: engine not started, frameworks run unpatched ({type(exc).__name__}: {exc})\n")
