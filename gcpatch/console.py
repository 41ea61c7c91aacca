"""Who says gcpatch's decision lines, and that they show on the console under any launcher.

Once per job: local rank 0 logs each distinct line at INFO, the other ranks at DEBUG. Ranks decide
from rank-independent facts, so global rank 0 publishes its lines in the process group's key-value
store and every other rank compares its own with them without waiting (at the latest at DDP
construction, gcpatch/agreement.py), logging a line that differs at WARNING. gcpatch's own stderr
handler prints a line only where no handler it propagates to would show it on a console, so the
host's logging configuration is never changed (docs/HOW-IT-WORKS.md, "Once per job").
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from gcpatch import headline, lifetime, ranks

log = logging.getLogger("gcpatch")
_said: set[str] = set()  # lines this process already logged at INFO
_seen: dict[str, int] = {}  # decision identity -> how often this process decided it
_mine: list[tuple[str, str]] = []  # (store key, line) that rank 0 has not published yet
_pending: list[tuple[str, str]] = []  # (store key, line) another rank has not compared yet
_PREFIX = "gcpatch/lines/"
_WAITING_MAX = 256  # lines kept for a process group that may never come


def speaker() -> bool:
    """Whether this process says the decision lines at INFO: local rank 0 (gcpatch/ranks.py)."""
    return ranks.local_rank() == 0


def say(
    line: str,
    detail: str,
    identity: str,
    level: int = logging.INFO,
    quiet: bool = False,
    gist: str = "",
) -> None:
    """Log one decision: the short line once per job, the detail at DEBUG on every rank. `gist` is
    what makes two lines the same news (a re-decision at a wrap that changed nothing is not)."""
    _awake()
    log.debug("%s", detail)
    key = f"{_PREFIX}{identity}#{_seen.get(identity, 0)}"
    _seen[identity] = _seen.get(identity, 0) + 1
    if quiet:
        log.debug("%s", line)
        return
    waiting = _mine if ranks.rank() == 0 else _pending
    waiting.append((key, line))
    if len(waiting) > _WAITING_MAX:  # no process group yet, a long job: the oldest are let go
        del waiting[: len(waiting) - _WAITING_MAX]
    if speaker() and (gist or line) not in _said:
        _said.add(gist or line)
        log.log(level, "%s", line)
    else:
        log.debug("%s", line)
    exchange()


def warn(text: str) -> None:
    """A warning attached to a decision (a rule over the user's ask, a conflict): once per job
    too."""
    _awake()
    if speaker() and text not in _said:
        _said.add(text)
        log.warning("%s", text)
    else:
        log.debug("%s", text)


def exchange(store: Any = None) -> None:
    """Publish rank 0's lines, and compare this rank's with those rank 0 published; never waits.
    agreement.py calls it once every rank has reached DDP's constructor."""
    if not _mine and not _pending:
        return
    try:
        store = store if store is not None else ranks.store()
        if store is None:
            return
        while _mine:
            key, line = _mine.pop(0)
            store.set(key, line)
        for key, line in list(_pending):
            if not store.check([key]):
                continue
            _pending.remove((key, line))
            theirs = store.get(key).decode("utf-8", "replace")
            if theirs != line:
                log.warning(
                    "gcpatch: rank %d decided differently from rank 0: %s (rank 0: %s)",
                    ranks.rank(),
                    line,
                    theirs,
                )
    except Exception as exc:  # noqa: BLE001 (a comparison is never worth the host's job)
        log.debug(
            "gcpatch: could not compare decision lines with rank 0 (%s: %s)",
            type(exc).__name__,
            exc,
        )
        _mine.clear()
        _pending.clear()


def _awake() -> None:
    # A host's dictConfig(disable_existing_loggers=True) after gcpatch started disables every
    # logger it does not name, gcpatch's own included: GCPATCH_LOG=off is how gcpatch is silenced.
    if log.disabled:
        log.disabled = False


@lifetime.activation
def forget() -> None:
    """Start over (a re-activation): every line may be said again."""
    _said.clear()
    _seen.clear()
    _mine.clear()
    _pending.clear()


# Handlers that put a record on the console: a stream on stderr/stdout, or a rich console.
def _shows(handler: logging.Handler, record: logging.LogRecord) -> bool:
    if isinstance(handler, ConsoleHandler) or record.levelno < handler.level:
        return False
    if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
        if not _on_console(getattr(handler, "stream", None)):
            return False
    elif "rich" not in type(handler).__module__.lower():
        return False
    try:
        return bool(handler.filter(record))
    except Exception:  # noqa: BLE001 (inside emit: a log line here would recurse; a failing filter shows nothing)
        return False


def _on_console(stream: Any) -> bool:
    """stdout or stderr, also behind a wrapper (colorama's, a tee that keeps the file
    descriptor)."""
    if stream is None:
        return False
    if any(stream is std for std in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)):
        return True
    try:
        return stream.fileno() in (1, 2)
    except Exception:  # noqa: BLE001 (StringIO, a file-only writer: not the console)
        return False


class WholeLines(logging.Formatter):
    """The message, every line of it at most one terminal row (headline.LIMIT), wrapped at words:
    what the source did not wrap itself (a long exception text in an error line) is not cut."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if all(len(line) <= headline.LIMIT for line in text.split("\n")):
            return text
        return "\n".join(headline.wrap(line) for line in text.split("\n"))


class ConsoleHandler(logging.StreamHandler):
    """gcpatch's own stderr handler: prints a line unless the host's handlers show it already."""

    def __init__(self) -> None:
        super().__init__()  # stderr, looked up at each emit: pytest and launchers swap it
        self.setFormatter(WholeLines("%(message)s"))

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        logger: logging.Logger | None = log
        while logger is not None:
            if any(_shows(h, record) for h in logger.handlers):
                return  # the host shows it
            if not logger.propagate:
                break
            logger = logger.parent
        super().emit(record)


def install(level: str) -> None:
    """gcpatch's logger at GCPATCH_LOG's level, with its console handler (once)."""
    _awake()
    if any(isinstance(h, ConsoleHandler) for h in log.handlers):
        return
    if level == "off":
        log.setLevel(logging.CRITICAL + 1)
        return
    log.setLevel(getattr(logging, level.upper(), logging.INFO))
    log.addHandler(ConsoleHandler())
