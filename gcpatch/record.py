"""Recording decisions: one short line each on the `gcpatch` logger, said once per job
(gcpatch/console.py; the details at DEBUG), a JSONL file per rank when GCPATCH_RECORD names a
directory, and an in-process history for `gcpatch.decisions()`."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from typing import Any

from gcpatch import console, headline, lifetime
from gcpatch.ranks import rank
from gcpatch.schema import CallFacts, Decision, Facts, Stage

log = logging.getLogger("gcpatch")
_history: list[dict[str, Any]] = []


def configure_logging(level: str) -> None:
    """gcpatch's logger and its console handler (gcpatch/console.py: visible under any launcher,
    without touching the host's own logging configuration)."""
    console.install(level)


def applied_rules(outcome: Decision, applied: dict[str, Any]) -> list[str]:
    """The rules behind what took effect: a vote for a hook that the choice did not need is
    shown by `explain` as such, not listed as applied."""
    rules: list[str] = []
    for knob, vote in outcome.winners.items():
        if knob in applied and vote.rule not in rules:
            rules.append(vote.rule)
    return rules


def history() -> list[dict[str, Any]]:
    return list(_history)


def decision(
    facts: Facts,
    outcome: Decision,
    applied: dict[str, Any],
    record_dir: str | None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Record one decision. `quiet` (the same decision again, e.g. trl#480's double enable)
    logs at DEBUG instead of INFO; the JSONL record is written either way."""
    entry = {
        "time": time.time(),
        "pid": os.getpid(),
        "rank": rank(),
        "world_size": facts.world_size,
        "stage": facts.stage,
        "model": facts.model_class,
        "api": facts.api,
        "source": facts.source,
        "asked": {"use_reentrant": facts.asked_use_reentrant, "from": facts.asked_from},
        "applied": applied,
        "rules": applied_rules(outcome, applied),
        # Only the knobs that took effect: a vote for a hook that reentrant did not need is noise.
        "why": {
            knob: f"{v.rule}: {v.reason}" for knob, v in outcome.winners.items() if knob in applied
        },
        "decision": outcome.to_dict(),
        "facts": facts.to_dict(),
    }
    _history.append(entry)
    console.say(
        summary(entry),
        headline.detail(entry),
        f"{facts.model_class}.{facts.api}/{facts.stage}/{facts.source}",
        quiet=quiet,
        gist=summary({**entry, "source": "call"}),
    )
    for text in outcome.warnings + outcome.conflicts:
        log.debug("gcpatch: warning: %s", text)
    for text in headline.warnings(entry):
        console.warn(text)
    if record_dir:
        _write(entry, record_dir)
    return entry


def call_site(
    site: str, facts: CallFacts, outcome: Decision, applied: dict[str, Any], record_dir: str | None
) -> dict[str, Any]:
    """Record what gcpatch did at one `checkpoint` call site: once per site and outcome, however
    many steps call it."""
    entry = {
        "time": time.time(),
        "pid": os.getpid(),
        "rank": rank(),
        "stage": "call",
        "site": site,
        "asked": {
            "use_reentrant": facts.asked_use_reentrant,
            "from": "the call" if facts.asked_use_reentrant is not None else "torch's default",
        },
        "applied": applied,
        "rules": [v.rule for k, v in outcome.winners.items() if k in applied],
        "why": {k: f"{v.rule}: {v.reason}" for k, v in outcome.winners.items() if k in applied},
        "decision": outcome.to_dict(),
        "facts": facts.to_dict(),
    }
    _history.append(entry)
    console.say(summary(entry), headline.detail(entry), f"call/{site}")
    for text in outcome.warnings + outcome.conflicts:
        log.debug("gcpatch: warning: %s (at %s)", text, site)
    for text in headline.warnings(entry):
        console.warn(text)
    if record_dir:
        _write(entry, record_dir)
    return entry


def disable(
    model: str, api: str, restored: dict[str, str], record_dir: str | None
) -> dict[str, Any]:
    """Record the user's disable: what gcpatch gave back so the model is as it would be
    without gcpatch (its hooks are always removed; `restored` lists the configs R6 changed)."""
    given_back = "; ".join(f"{change} on {where}" for where, change in restored.items())
    line = f"gcpatch: {model}: {api} gave back " + (given_back or "nothing but its hooks")
    entry = event(
        {"stage": Stage.DISABLE, "model": model, "api": api, "restored": restored, "line": line},
        record_dir,
    )
    # said once per job like a decision; a disable that gave back only hooks is said at DEBUG
    console.say(
        line,
        f"{line} (rank {rank()}; gcpatch's input-grads and first-forward hooks removed)",
        f"{model}.{api}/disable",
        quiet=not restored,
    )
    return entry


def failure(stage: str, text: str, record_dir: str | None) -> None:
    """Record a decision that failed open: the host ran with its own behaviour."""
    entry = {
        "time": time.time(),
        "pid": os.getpid(),
        "rank": rank(),
        "stage": stage,
        "failed_open": text,
    }
    _history.append(entry)
    if record_dir:
        _write(entry, record_dir)


def event(entry: dict[str, Any], record_dir: str | None) -> dict[str, Any]:
    """Record what is not a decision (a verify result, a crash explanation): `entry` carries its
    own `stage` and a ready-made `line` for `gcpatch explain`; it is logged by its owner."""
    entry = {"time": time.time(), "pid": os.getpid(), "rank": rank(), **entry}
    _history.append(entry)
    if record_dir:
        _write(entry, record_dir)
    return entry


def summary(entry: dict[str, Any]) -> str:
    """The short line a decision gets (gcpatch/headline.py); `headline.detail` has the rest."""
    return headline.line(entry)


def read(path: str) -> list[dict[str, Any]]:
    """Every readable record under a GCPATCH_RECORD directory (or in one JSONL file), rank by
    rank. Damaged lines are skipped; `scan` also says which."""
    return scan(path).entries


class Scan:
    """What `scan` found: the records, and every line or file it could not read (a rank
    killed mid-write leaves a truncated line; `gcpatch explain` reports them, never crashes)."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.damaged: list[str] = []  # "file:line: why"


def scan(path: str) -> Scan:
    found = Scan()
    try:
        files = (
            [path]
            if not os.path.isdir(path)
            else [
                os.path.join(path, name)
                for name in sorted(os.listdir(path))
                if name.endswith(".jsonl")
            ]
        )
    except OSError as exc:
        found.damaged.append(f"{path}: cannot list ({type(exc).__name__}: {exc})")
        return found
    for name in files:
        try:
            with open(name, "rb") as handle:
                lines = handle.read().split(b"\n")
        except OSError as exc:
            found.damaged.append(f"{name}: cannot read ({type(exc).__name__}: {exc})")
            continue
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                entry = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                found.damaged.append(f"{name}:{number}: not a JSON record ({type(exc).__name__})")
                continue
            if not isinstance(entry, dict):
                found.damaged.append(
                    f"{name}:{number}: a JSON {type(entry).__name__}, not a record"
                )
                continue
            found.entries.append(entry)
    found.entries.sort(key=lambda e: (_number(e.get("rank")), _number(e.get("time"))))
    return found


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


# Paths whose write already failed: reported once, then skipped quietly (the job goes on).
_unwritable: dict[str, str] = {}
# Read and write (the last byte says whether a killed writer left half a line); never through a
# symlink; non-blocking, so a FIFO planted there cannot hang the job.
_OPEN_FLAGS = (
    os.O_RDWR
    | os.O_APPEND
    | os.O_CREAT
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def _write(entry: dict[str, Any], record_dir: str) -> bool:
    """Append one line to this rank's file. Never raises into the host: a record that cannot
    be written (an existing file in the way, a read-only directory, a planted symlink, a FIFO)
    is reported once with its path and reason, and the decision itself stands."""
    path = os.path.join(record_dir, f"gcpatch-rank{entry.get('rank', 0)}.jsonl")
    try:
        line = (json.dumps(entry, default=repr) + "\n").encode("utf-8")
        foreign = _foreign_link(record_dir)
        if foreign:
            raise OSError(
                f"{foreign} is a symbolic link owned by another user, which gcpatch never follows"
            )
        if not os.path.isdir(record_dir):
            os.makedirs(record_dir, mode=0o700, exist_ok=True)  # ours: only this user reads it
        fd = os.open(path, _OPEN_FLAGS, 0o600)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise OSError(f"not a regular file (mode {stat.filemode(info.st_mode)})")
            if hasattr(os, "getuid") and info.st_uid != os.getuid():
                raise OSError(f"owned by uid {info.st_uid}, not by this user")
            if info.st_size and os.pread(fd, 1, info.st_size - 1) != b"\n":
                line = b"\n" + line  # a writer killed mid-line: start ours on a line of its own
            while line:
                line = line[os.write(fd, line) :]
        finally:
            os.close(fd)
    except Exception as exc:  # noqa: BLE001 (the record must never cost the host its job)
        reason = f"{type(exc).__name__}: {exc}"
        if _errno_of(exc) == errno.ELOOP:
            reason = "it is a symbolic link, which gcpatch never follows"
        if path not in _unwritable:
            _unwritable[path] = reason
            log.error(
                "gcpatch: cannot write the record %s (%s); decisions are still logged and the job"
                " goes on",
                path,
                reason,
            )
        return False
    return True


def _foreign_link(record_dir: str) -> str:
    """The first component of `record_dir` that is a symlink owned by neither this user nor root,
    or ''. Another user's link could send this user's records wherever they like; root's (/var/run,
    macOS's /tmp) are the system's own. Checked once per directory and process."""
    if record_dir in _checked_dirs:
        return _checked_dirs[record_dir]
    found = ""
    uid = os.getuid() if hasattr(os, "getuid") else None
    current = os.path.abspath(record_dir)
    parts = []
    while True:
        head, tail = os.path.split(current)
        if not tail:
            break
        parts.append(current)
        current = head
    for part in reversed(parts):  # from the root down
        try:
            info = os.lstat(part)
        except OSError:
            break  # not there yet: created below, by this user
        if uid is not None and stat.S_ISLNK(info.st_mode) and info.st_uid not in (uid, 0):
            found = part
            break
    _checked_dirs[record_dir] = found
    return found


_checked_dirs: dict[str, str] = {}


def _errno_of(exc: BaseException) -> int | None:
    return getattr(exc, "errno", None)


@lifetime.activation
def reset() -> None:
    """Forget the in-process history and what was found about record paths."""
    _history.clear()
    _unwritable.clear()
    _checked_dirs.clear()
