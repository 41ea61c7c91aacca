"""Recording decisions: one INFO line each on the `gcpatch` logger, a JSONL file per rank when
GCPATCH_RECORD names a directory, and an in-process history for `gcpatch.decisions()`."""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from gcpatch.facts import rank
from gcpatch.schema import CallFacts, Decision, Facts

log = logging.getLogger("gcpatch")
_history: list[dict[str, Any]] = []


class _FallbackHandler(logging.StreamHandler):
    """Prints gcpatch's lines on stderr unless the application configured logging itself."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the root logger's handlers get it through propagation
        super().emit(record)


def configure_logging(level: str) -> None:
    if any(isinstance(h, _FallbackHandler) for h in log.handlers):
        return
    if level == "off":
        log.setLevel(logging.CRITICAL + 1)
        return
    log.setLevel(getattr(logging, level.upper(), logging.INFO))
    handler = _FallbackHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)


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
    facts: Facts, outcome: Decision, applied: dict[str, Any], record_dir: str | None, quiet: bool = False
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
        "why": {knob: f"{v.rule}: {v.reason}" for knob, v in outcome.winners.items() if knob in applied},
        "decision": outcome.to_dict(),
        "facts": facts.to_dict(),
    }
    _history.append(entry)
    log.log(logging.DEBUG if quiet else logging.INFO, "%s", summary(entry))
    for text in outcome.warnings + outcome.conflicts:
        log.warning("gcpatch: warning: %s", text)
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
        "asked": {"use_reentrant": facts.asked_use_reentrant,
                  "from": "the call" if facts.asked_use_reentrant is not None else "torch's default"},
        "applied": applied,
        "rules": [v.rule for k, v in outcome.winners.items() if k in applied],
        "why": {k: f"{v.rule}: {v.reason}" for k, v in outcome.winners.items() if k in applied},
        "decision": outcome.to_dict(),
        "facts": facts.to_dict(),
    }
    _history.append(entry)
    log.info("%s", summary(entry))
    for text in outcome.warnings + outcome.conflicts:
        log.warning("gcpatch: warning: %s (at %s)", text, site)
    if record_dir:
        _write(entry, record_dir)
    return entry


def failure(stage: str, text: str, record_dir: str | None) -> None:
    """Record a decision that failed open: the host ran with its own behaviour."""
    entry = {"time": time.time(), "pid": os.getpid(), "rank": rank(), "stage": stage, "failed_open": text}
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
    """The one line a decision gets: where, what was asked, what was applied, which rule, why."""
    if "failed_open" in entry:
        return f"gcpatch: rank {entry['rank']} {entry['stage']}: failed open, original behaviour ({entry['failed_open']})"
    if entry.get("stage") == "call":
        applied = ", ".join(f"{k}={v}" for k, v in entry["applied"].items()) or "left as called"
        why = "; ".join(entry["why"].values())
        return f"gcpatch: rank {entry['rank']} checkpoint call at {entry['site']}: {applied}" + (f" | {why}" if why else "")
    asked = entry["asked"]
    ask = "nothing" if asked["use_reentrant"] is None else f"use_reentrant={asked['use_reentrant']}"
    applied = ", ".join(f"{k}={v}" for k, v in entry["applied"].items()) or "nothing"
    why = "; ".join(f"{knob}: {reason}" for knob, reason in entry["why"].items())
    head = f"gcpatch: rank {entry['rank']} {entry['model']}.{entry['api']} ({entry['source']}, {entry['stage']})"
    return f"{head}: asked {ask} [{asked['from']}] -> applied {applied} | {why}"


def read(path: str) -> list[dict[str, Any]]:
    """Every record under a GCPATCH_RECORD directory (or in one JSONL file), rank by rank."""
    files = [path] if os.path.isfile(path) else [
        os.path.join(path, name) for name in sorted(os.listdir(path)) if name.endswith(".jsonl")
    ]
    entries = []
    for name in files:
        with open(name, encoding="utf-8") as handle:
            entries.extend(json.loads(line) for line in handle if line.strip())
    return sorted(entries, key=lambda e: (e.get("rank", 0), e.get("time", 0)))


def _write(entry: dict[str, Any], record_dir: str) -> None:
    os.makedirs(record_dir, exist_ok=True)
    path = os.path.join(record_dir, f"gcpatch-rank{entry['rank']}.jsonl")
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry, default=repr) + "\n")
