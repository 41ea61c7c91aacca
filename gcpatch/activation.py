"""Switching gcpatch on and off, and starting the engine at the first framework import.

The watcher lives in the start-up module (`_gcpatch_startup`), so GCPATCH=1 costs one small module
at interpreter start-up; this package loads when a framework is first imported, or when the user
imports it. Either way the engine is armed only once a framework is imported (its patch points
registered by name), never imports one itself, and loads the plugins (pluggy, entry points) at the
first call through a patch point.
"""

from __future__ import annotations

import os
import sys

import _gcpatch_startup
from gcpatch import settings

TRIGGERS = _gcpatch_startup.TRIGGERS

_active = False
# GCPATCH as the process found it, before activate() set it for children (for `gcpatch doctor`).
ENV_AT_START = os.environ.get("GCPATCH")


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
        settings.say_unknown()
        # Children (subprocess, torchrun/accelerate/deepspeed ranks) start through the .pth line.
        os.environ.setdefault("GCPATCH", "1")
        _gcpatch_startup.watch(framework_imported)
        return True
    except Exception as exc:  # noqa: BLE001 (fail open: never break the host's start-up)
        sys.stderr.write(f"gcpatch: not activated ({type(exc).__name__}: {exc})\n")
        return False


def framework_imported() -> None:
    """A trigger package is being imported (or already is): start the engine if gcpatch is on."""
    if _active:
        _gcpatch_startup.unwatch()
        _start_engine()


def deactivate() -> None:
    """Remove the watcher and every installed patch, restoring the originals."""
    global _active
    _active = False
    _gcpatch_startup.unwatch()
    if "gcpatch.engine" in sys.modules:
        sys.modules["gcpatch.engine"].stop()


def is_active() -> bool:
    return _active


def _start_engine() -> None:
    try:
        from gcpatch import engine

        engine.arm()  # the plugins load at the first call through a patch point
    except Exception as exc:  # fail open: one line, the frameworks' own behaviour
        if settings.read().strict:
            raise
        sys.stderr.write(
            f"gcpatch: engine not started, frameworks run unpatched ({type(exc).__name__}: {exc})\n"
        )
