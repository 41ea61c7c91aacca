"""gcpatch's environment variables, read in one place.

A bad value never raises: it is reported once on stderr, in words that say exactly what gcpatch
does instead, because gcpatch runs inside other people's jobs (fail open).
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
    report_once(
        "GCPATCH",
        f"gcpatch: GCPATCH={raw!r} is neither 1 nor 0; gcpatch stays off, as with GCPATCH=0 "
        "(set GCPATCH=1 to switch it on)",
    )
    return False


class Settings:
    """The parsed variables. A plain class: this module is on the start-up path, where
    importing dataclasses (and with it inspect) would cost more than gcpatch itself."""

    __slots__ = ("mode", "record_dir", "blocked_plugins", "log_level", "verify", "memory_budget")

    def __init__(
        self,
        mode: str = "fix",
        record_dir: str | None = None,
        blocked_plugins: frozenset[str] = frozenset(),
        log_level: str = "info",
        verify: bool = False,
        memory_budget: object = None,
    ) -> None:
        self.mode = mode
        self.record_dir = record_dir
        self.blocked_plugins = blocked_plugins
        self.log_level = log_level
        self.verify = (
            verify  # GCPATCH_VERIFY=1: check each model's first training step (gcpatch/verify.py)
        )
        self.memory_budget = (
            memory_budget  # GCPATCH_MEMORY_BUDGET, a gcpatch.budget.Budget (gcpatch/planner.py)
        )

    @property
    def strict(self) -> bool:
        return self.mode == "strict"


def read() -> Settings:
    """Read GCPATCH_MODE, GCPATCH_RECORD, GCPATCH_DISABLE_PLUGINS, GCPATCH_LOG, GCPATCH_VERIFY and
    GCPATCH_MEMORY_BUDGET."""
    mode = os.environ.get("GCPATCH_MODE", "fix").strip().lower() or "fix"
    if mode not in MODES:
        _bad("GCPATCH_MODE", mode, " | ".join(MODES), "fix")
        mode = "fix"
    log_level = os.environ.get("GCPATCH_LOG", "info").strip().lower() or "info"
    if log_level not in _LOG_LEVELS:
        _bad("GCPATCH_LOG", log_level, " | ".join(_LOG_LEVELS), "info")
        log_level = "info"
    blocked = frozenset(
        name.strip()
        for name in os.environ.get("GCPATCH_DISABLE_PLUGINS", "").split(",")
        if name.strip()
    )
    record_dir = os.environ.get("GCPATCH_RECORD", "").strip() or None
    verify = os.environ.get("GCPATCH_VERIFY", "").strip().lower() in _TRUE
    return Settings(
        mode=mode,
        record_dir=record_dir,
        blocked_plugins=blocked,
        log_level=log_level,
        verify=verify,
        memory_budget=memory_budget(),
    )


def memory_budget() -> object:
    """GCPATCH_MEMORY_BUDGET: a fraction of the activations (0.5) or a size (6GiB, 800MB), parsed
    by gcpatch.budget (imported only when the variable is set: this module is on the start-up path).
    """
    raw = os.environ.get("GCPATCH_MEMORY_BUDGET", "")
    if not raw.strip():
        return None
    from gcpatch.budget import parse

    parsed = parse(raw)
    if isinstance(parsed, str):
        report_once(
            "GCPATCH_MEMORY_BUDGET",
            f"gcpatch: GCPATCH_MEMORY_BUDGET={raw!r} is {parsed}; no budget is "
            "applied, every layer whose checkpointing is on recomputes as without the variable",
        )
        return None
    return parsed


def local_plugins() -> bool:
    """GCPATCH_LOCAL_PLUGINS=1: also load plugins from a *.dist-info in the script's own folder."""
    raw = os.environ.get("GCPATCH_LOCAL_PLUGINS", "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value not in _FALSE:
        report_once(
            "GCPATCH_LOCAL_PLUGINS",
            f"gcpatch: GCPATCH_LOCAL_PLUGINS={raw!r} is neither 1 nor 0; "
            "plugins next to the script are not loaded, as with 0",
        )
    return False


def int_env(name: str, default: int, meaning: str) -> int:
    """An integer launcher variable (RANK, WORLD_SIZE); a bad value is named once with the
    value gcpatch uses instead."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw.strip())
    except ValueError:
        report_once(
            name,
            f"gcpatch: {name}={raw!r} is not an integer; gcpatch uses {default} as {meaning} "
            "(your launcher may read it differently)",
        )
        return default


def report_once(key: str, line: str) -> None:
    """Write one line on stderr the first time `key` is reported in this process."""
    if key in _reported:
        return
    _reported.add(key)
    sys.stderr.write(line + "\n")


def _bad(name: str, value: str, expected: str, used: str) -> None:
    report_once(name, f"gcpatch: {name}={value!r} is not one of {expected}; using {used}")
