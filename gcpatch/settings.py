"""gcpatch's environment variables, read in one place.

A bad value never raises: it is reported once on stderr and the default is used, because
gcpatch runs inside other people's jobs (design card: fail open).
"""
from __future__ import annotations

import os
import sys

MODES = ("fix", "warn", "strict", "off")
_FALSE = ("", "0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")
_LOG_LEVELS = ("debug", "info", "warning", "error", "off")
_reported: set[str] = set()


def env_switch() -> bool | None:
    """GCPATCH: True (on), False (explicitly off) or None (unset)."""
    raw = os.environ.get("GCPATCH")
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    _bad("GCPATCH", raw, "1 or 0")
    return False


class Settings:
    """The parsed variables. A plain class: this module is on the start-up path, where
    importing dataclasses (and with it inspect) would cost more than gcpatch itself."""

    __slots__ = ("mode", "record_dir", "blocked_plugins", "log_level", "verify")

    def __init__(
        self,
        mode: str = "fix",
        record_dir: str | None = None,
        blocked_plugins: frozenset[str] = frozenset(),
        log_level: str = "info",
        verify: bool = False,
    ) -> None:
        self.mode = mode
        self.record_dir = record_dir
        self.blocked_plugins = blocked_plugins
        self.log_level = log_level
        self.verify = verify  # GCPATCH_VERIFY=1: check each model's first training step (gcpatch/verify.py)

    @property
    def strict(self) -> bool:
        return self.mode == "strict"


def read() -> Settings:
    """Read GCPATCH_MODE, GCPATCH_RECORD, GCPATCH_DISABLE_PLUGINS, GCPATCH_LOG and GCPATCH_VERIFY."""
    mode = os.environ.get("GCPATCH_MODE", "fix").strip().lower() or "fix"
    if mode not in MODES:
        _bad("GCPATCH_MODE", mode, " | ".join(MODES))
        mode = "fix"
    log_level = os.environ.get("GCPATCH_LOG", "info").strip().lower() or "info"
    if log_level not in _LOG_LEVELS:
        _bad("GCPATCH_LOG", log_level, " | ".join(_LOG_LEVELS))
        log_level = "info"
    blocked = frozenset(
        name.strip() for name in os.environ.get("GCPATCH_DISABLE_PLUGINS", "").split(",") if name.strip()
    )
    record_dir = os.environ.get("GCPATCH_RECORD", "").strip() or None
    verify = os.environ.get("GCPATCH_VERIFY", "").strip().lower() in _TRUE
    return Settings(mode=mode, record_dir=record_dir, blocked_plugins=blocked, log_level=log_level, verify=verify)


def _bad(name: str, value: str, expected: str) -> None:
    if name in _reported:
        return
    _reported.add(name)
    sys.stderr.write(f"gcpatch: ignoring {name}={value!r}: expected {expected}; using the default\n")
