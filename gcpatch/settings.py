"""gcpatch's environment variables, read in one place.

A bad value never raises and never costs more than its own feature: each variable is read on its
own, and a value it cannot use (or a failure reading it) is reported once on stderr, naming the
variable and saying exactly what gcpatch does instead, while every other variable still applies.
A variable that is set but empty is reported the same way (unset it to mean its default). gcpatch
runs inside other people's jobs: it fails open.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import _gcpatch_startup
from gcpatch import lifetime

MODES = ("fix", "warn", "strict", "off")
# The one rule of every on/off variable (GCPATCH, GCPATCH_VERIFY, GCPATCH_LOCAL_PLUGINS), any case:
_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")
FLAG_RULE = "1, true, yes or on switch it on; 0, false, no or off switch it off"
_LOG_LEVELS = ("debug", "info", "warning", "error", "off")
# Every variable gcpatch reads (docs and `gcpatch doctor` list them from here).
VARIABLES = (
    "GCPATCH",
    "GCPATCH_MODE",
    "GCPATCH_RECORD",
    "GCPATCH_DISABLE_PLUGINS",
    "GCPATCH_LOG",
    "GCPATCH_VERIFY",
    "GCPATCH_MEMORY_BUDGET",
    "GCPATCH_BUDGET_LEVERS",
    "GCPATCH_LOCAL_PLUGINS",
    "GCPATCH_PLUGIN_TIMEOUT_S",
)
PLUGIN_TIMEOUT_S = 10.0
_reported: set[str] = set()  # each bad value is said once per activation


@lifetime.activation
def reset() -> None:
    _reported.clear()


def env_switch() -> bool | None:
    """GCPATCH: True (on), False (explicitly off) or None (unset)."""
    return switch(os.environ.get("GCPATCH"))


def switch(raw: str | None) -> bool | None:
    """A value of GCPATCH (`gcpatch doctor` reads the one its process started with)."""
    if raw is None:
        return None
    if not raw.strip():
        _bad("GCPATCH", raw, "set but empty", "gcpatch stays off, as with GCPATCH=0")
        return False
    return _flag("GCPATCH", raw, "gcpatch stays off, as with GCPATCH=0")


def _flag(name: str, raw: str, instead: str) -> bool:
    """An on/off variable by the one rule (FLAG_RULE); any other value is said and means off."""
    value = raw.strip().lower()
    if value not in _TRUE and value not in _FALSE:
        _bad(name, raw, f"not an on/off value ({FLAG_RULE})", instead)
    return value in _TRUE


def unknown_names() -> list[str]:
    """The GCPATCH_* variables set here that gcpatch does not read (its tools' own aside)."""
    return [name for name in _gcpatch_startup.set_variables() if name not in VARIABLES]


def say_unknown() -> None:
    """One line for each GCPATCH_* variable gcpatch does not read, naming the closest it does
    (a misspelt GCPATCH_VERFY would otherwise leave verify off in silence)."""
    unknown = unknown_names()
    if not unknown:
        return
    import difflib  # only where a name is unknown: this module is on the start-up path

    for name in unknown:
        ratios = sorted(  # by the words after GCPATCH_, which every name shares
            (
                (difflib.SequenceMatcher(None, name[8:], known[8:]).ratio(), known)
                for known in VARIABLES[1:]
            ),
            reverse=True,
        )
        close = [known for ratio, known in ratios if ratio >= max(0.6, ratios[0][0] - 0.05)]
        hint = f"did you mean {' or '.join(close)}?" if close else "see `gcpatch doctor`"
        report_once(name, f"gcpatch: {name} is not a gcpatch variable and is ignored; {hint}")


class Settings:
    """The parsed variables. A plain class: this module is on the start-up path, where
    importing dataclasses (and with it inspect) would cost more than gcpatch itself."""

    __slots__ = (
        "mode",
        "record_dir",
        "blocked_plugins",
        "log_level",
        "verify",
        "memory_budget",
        "plugin_timeout_s",
    )

    def __init__(
        self,
        mode: str = "fix",
        record_dir: str | None = None,
        blocked_plugins: frozenset[str] = frozenset(),
        log_level: str = "info",
        verify: bool = False,
        memory_budget: object = None,
        plugin_timeout_s: float = 10.0,
    ) -> None:
        self.mode = mode
        self.record_dir = record_dir
        self.blocked_plugins = blocked_plugins
        self.log_level = log_level
        # GCPATCH_VERIFY=1: check each model's first training step (gcpatch/step/verify.py)
        self.verify = verify
        # GCPATCH_MEMORY_BUDGET, a gcpatch.budget.Budget (gcpatch/step/planner.py)
        self.memory_budget = memory_budget
        # GCPATCH_PLUGIN_TIMEOUT_S: the wait for a third-party plugin's import or hook
        self.plugin_timeout_s = plugin_timeout_s

    @property
    def strict(self) -> bool:
        return self.mode == "strict"


def read() -> Settings:
    """Every variable but GCPATCH (`env_switch`), each on its own (`_guarded`)."""
    return Settings(
        mode=_guarded("GCPATCH_MODE", _mode, "fix", "using fix"),
        record_dir=_guarded("GCPATCH_RECORD", _record_dir, None, "nothing is recorded"),
        blocked_plugins=_guarded(
            "GCPATCH_DISABLE_PLUGINS", _blocked, frozenset(), "no plugin is blocked"
        ),
        log_level=_guarded("GCPATCH_LOG", _log_level, "info", "using info"),
        verify=_guarded("GCPATCH_VERIFY", _verify, False, "verify stays off"),
        memory_budget=_guarded("GCPATCH_MEMORY_BUDGET", _memory_budget, None, _NO_BUDGET),
        plugin_timeout_s=plugin_timeout(),
    )


def _guarded(name: str, parse: Callable[[str], Any], default: Any, instead: str) -> Any:
    """One variable's value, parsed by `parse` from its raw text; unset: `default`. A set-but-empty
    value, or a failure inside `parse`, is said once and gives `default`: one variable never
    costs another its value."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not raw.strip():
        _bad(name, raw, "set but empty", f"{instead} (unset it to mean the default)")
        return default
    try:
        return parse(raw)
    except Exception as exc:  # noqa: BLE001 (fail open: this variable only, said in one line)
        _bad(name, raw, f"not readable ({type(exc).__name__}: {exc})", instead)
        return default


def _mode(raw: str) -> str:
    mode = raw.strip().lower()
    if mode not in MODES:
        _bad("GCPATCH_MODE", raw, f"not one of {' | '.join(MODES)}", "using fix")
        return "fix"
    return mode


def _log_level(raw: str) -> str:
    level = raw.strip().lower()
    if level not in _LOG_LEVELS:
        _bad("GCPATCH_LOG", raw, f"not one of {' | '.join(_LOG_LEVELS)}", "using info")
        return "info"
    return level


def _blocked(raw: str) -> frozenset[str]:
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def _record_dir(raw: str) -> str | None:
    """A directory for the record (created when gcpatch first writes). A file in its place is said
    now, at start-up, not at the first decision."""
    path = raw.strip()
    if "\x00" in path:
        _bad("GCPATCH_RECORD", raw, "not a path (it holds a NUL byte)", "nothing is recorded")
        return None
    if os.path.exists(path) and not os.path.isdir(path):
        _bad("GCPATCH_RECORD", raw, "a file, not a directory", "nothing is recorded")
        return None
    return path


def _verify(raw: str) -> bool:
    return _flag("GCPATCH_VERIFY", raw, "verify stays off, as with 0")


_NO_BUDGET = (
    "no budget is applied, every layer whose checkpointing is on recomputes as without the variable"
)


def _memory_budget(raw: str) -> object:
    """GCPATCH_MEMORY_BUDGET: a fraction of each step's activations (0.5), a size (6GiB, 800MB) or
    auto (auto:24GiB), parsed by gcpatch.budget (imported only when the variable is set: this
    module is on the start-up path)."""
    from gcpatch.budget import parse

    parsed = parse(raw)
    if isinstance(parsed, str):
        _bad("GCPATCH_MEMORY_BUDGET", raw, f"not a budget: {parsed}", _NO_BUDGET, verb="is")
        return None
    return parsed


def memory_budget() -> object:
    """GCPATCH_MEMORY_BUDGET alone (what `read()` gives as `memory_budget`)."""
    return _guarded("GCPATCH_MEMORY_BUDGET", _memory_budget, None, _NO_BUDGET)


def budget_levers() -> bool:
    """GCPATCH_BUDGET_LEVERS: `all` (the default) lets the budget's plan use every lever a layer
    offers; `whole` keeps it to whole layers."""

    def parse(raw: str) -> bool:
        value = raw.strip().lower()
        if value not in ("all", "whole"):
            _bad("GCPATCH_BUDGET_LEVERS", raw, "neither all nor whole", "every lever, as with all")
        return value != "whole"

    return _guarded("GCPATCH_BUDGET_LEVERS", parse, True, "every lever")


def local_plugins() -> bool:
    """GCPATCH_LOCAL_PLUGINS=1: also load plugins from a *.dist-info in the script's own folder."""

    def parse(raw: str) -> bool:
        return _flag(
            "GCPATCH_LOCAL_PLUGINS", raw, "plugins next to the script are not loaded, as with 0"
        )

    return _guarded(
        "GCPATCH_LOCAL_PLUGINS", parse, False, "plugins next to the script are not loaded"
    )


def plugin_timeout() -> float:
    """GCPATCH_PLUGIN_TIMEOUT_S: how long gcpatch waits for a third-party plugin's import or
    hook."""

    def parse(raw: str) -> float:
        try:  # ASCII only: float() would also read other scripts' digits
            value = float(raw.strip()) if raw.strip().isascii() else float("nan")
        except ValueError:
            value = float("nan")
        if not (0 < value < 86400):  # NaN, infinities, negatives, a day or more: not a timeout
            _bad(
                "GCPATCH_PLUGIN_TIMEOUT_S",
                raw,
                "not a number of seconds in (0, 86400)",
                f"using {PLUGIN_TIMEOUT_S:g}",
            )
            return PLUGIN_TIMEOUT_S
        return value

    return _guarded(
        "GCPATCH_PLUGIN_TIMEOUT_S", parse, PLUGIN_TIMEOUT_S, f"using {PLUGIN_TIMEOUT_S:g}"
    )


def set_but_unused() -> list[str]:
    """The GCPATCH_* variables set in this environment (what `gcpatch doctor` names when gcpatch
    is off and they protect nothing)."""
    return [name for name in VARIABLES[1:] if name in os.environ]


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
    try:
        try:
            sys.stderr.write(line + "\n")
        except UnicodeEncodeError:  # a stderr that cannot encode the value: escaped
            sys.stderr.write(line.encode("ascii", "backslashreplace").decode("ascii") + "\n")
    except (OSError, ValueError, AttributeError):  # no stderr, or a closed one: nothing to say
        pass


def _bad(name: str, raw: str, what: str, instead: str, verb: str = "is") -> None:
    report_once(f"{name}={raw}", f"gcpatch: {name}={raw!r} {verb} {what}; {instead}")
