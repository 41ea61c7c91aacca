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

from gcpatch import console, headline, lifetime, nofollow
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
    instance: int = 1,
) -> dict[str, Any]:
    """Record one decision. `quiet` (the same decision again, e.g. trl#480's double enable)
    logs at DEBUG instead of INFO; the JSONL record is written either way. `instance`: the
    model's number among the models of its class (gcpatch/context.py)."""
    entry = {
        "time": time.time(),
        "pid": os.getpid(),
        "rank": rank(),
        "world_size": facts.world_size,
        "stage": facts.stage,
        "model": facts.model_class,
        "instance": instance,
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
    entry = _keep(entry, record_dir)
    console.say(
        summary(entry),
        headline.detail(entry),
        f"{facts.model_class}.{facts.api}/{facts.stage}/{facts.source}",
        level=headline.level(entry),
        quiet=quiet,
        gist=summary({**entry, "source": "call"}),
    )
    for text in outcome.warnings + outcome.conflicts:
        log.debug("gcpatch: warning: %s", text)
    for text in headline.warnings(entry):
        console.warn(text)
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
    entry = _keep(entry, record_dir)
    console.say(summary(entry), headline.detail(entry), f"call/{site}", level=headline.level(entry))
    for text in outcome.warnings + outcome.conflicts:
        log.debug("gcpatch: warning: %s (at %s)", text, site)
    for text in headline.warnings(entry):
        console.warn(text)
    return entry


def disable(
    model: str, api: str, restored: dict[str, str], record_dir: str | None, instance: int = 1
) -> dict[str, Any]:
    """Record the user's disable: what gcpatch gave back so the model is as it would be
    without gcpatch (its hooks are always removed; `restored` lists the configs R6 changed)."""
    given_back = "; ".join(f"{change} on {where}" for where, change in restored.items())
    named = model + (f" #{instance}" if instance > 1 else "")
    line = f"gcpatch: {named}: {api} gave back " + (given_back or "nothing but its hooks")
    entry = event(
        {
            "stage": Stage.DISABLE,
            "model": model,
            "instance": instance,
            "api": api,
            "restored": restored,
            "line": line,
        },
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
    _keep(entry, record_dir)


def event(entry: dict[str, Any], record_dir: str | None) -> dict[str, Any]:
    """Record what is not a decision (a verify result, a crash explanation): `entry` carries its
    own `stage` and a ready-made `line` for `gcpatch explain`; it is logged by its owner."""
    entry = {"time": time.time(), "pid": os.getpid(), "rank": rank(), **entry}
    return _keep(entry, record_dir)


# At most this many distinct entries stay in the in-process history (oldest dropped first).
HISTORY_MAX = 1000
# The last entry of each identity (stage, model, api, source, site) and record directory: what a
# repeat is counted on.
_last_of: dict[tuple, dict[str, Any]] = {}
_VOLATILE = ("time", "pid", "repeats")


def _keep(entry: dict[str, Any], record_dir: str | None) -> dict[str, Any]:
    """Append `entry` to the history and the record, or count it where it repeats the last entry
    of its identity (a loop that disables and enables every step, as RL trainers do): a repeated
    decision is a count, not a new entry. The record gets a `repeat` line at the 1st, 2nd, 4th,
    8th ... repeat, so it grows with the logarithm of the repeats, and the history holds at most
    HISTORY_MAX entries. Returns the entry that stands for this one."""
    identity = tuple(
        str(entry.get(k, "")) for k in ("stage", "model", "instance", "api", "source", "site")
    )
    # a record directory of its own (the variable is read at each decision) gets the entry itself
    last = _last_of.get((*identity, record_dir))
    if last is not None and _content(last) == _content(entry):
        last["repeats"] = count = last.get("repeats", 0) + 1
        if record_dir and count & (count - 1) == 0:
            _write(
                {
                    "time": entry.get("time"),
                    "pid": entry.get("pid"),
                    "rank": entry.get("rank"),
                    "stage": "repeat",
                    "of": dict(
                        zip(("stage", "model", "instance", "api", "source", "site"), identity)
                    ),
                    "repeats": count,
                },
                record_dir,
            )
        return last
    _last_of[(*identity, record_dir)] = entry
    _history.append(entry)
    if len(_history) > HISTORY_MAX:
        del _history[: len(_history) - HISTORY_MAX]
    if record_dir:
        _write(entry, record_dir)
    return entry


def _content(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in _VOLATILE}


def summary(entry: dict[str, Any]) -> str:
    """The short line a decision gets (gcpatch/headline.py); `headline.detail` has the rest."""
    return headline.line(entry)


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
        if nofollow.supported():  # every component walked afresh: no link another user owns
            fd = nofollow.open_under(record_dir, os.path.basename(path), _OPEN_FLAGS, 0o600)
        else:
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


def _errno_of(exc: BaseException) -> int | None:
    return getattr(exc, "errno", None)


@lifetime.activation
def reset() -> None:
    """Forget the in-process history and which record paths could not be written."""
    _history.clear()
    _last_of.clear()
    _unwritable.clear()
