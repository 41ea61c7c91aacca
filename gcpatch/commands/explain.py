"""`gcpatch explain`: a record directory read back, one whole line a decision, per rank and run.

A record is read as hostile input: it may hold a line a killed rank left half-written, a line that
is JSON but not a record, numbers no clock can show, paths that are not valid UTF-8 or nesting deep
enough to exhaust the parser, any JSON in any field. None of it stops the reading: what cannot be
read or shown is counted and named (file:line and why), what is missing is said per line, and what
is printed is printable on this console.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

# What the short line and the detail lines read from a decision record, and their types.
_DECISION_FIELDS = {
    "rank": object,
    "stage": object,
    "model": object,
    "api": object,
    "source": object,
    "asked": dict,
    "applied": dict,
    "why": dict,
    "decision": dict,
}
_CALL_FIELDS = {
    "rank": object,
    "site": object,
    "asked": dict,
    "applied": dict,
    "why": dict,
    "decision": dict,
}
_DETAIL_FIELDS = {"winners": dict, "overruled": list, "warnings": list, "conflicts": list}
_DAMAGED_SHOWN = 20


class Scan:
    """What `scan` found: the records, and every line or file it could not read (a rank killed
    mid-write leaves a truncated line)."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.damaged: list[str] = []  # "file:line: why"
        self.torn = 0  # damaged lines that began as a record does (`{`): a record cut short
        # id(entry) -> "file:line": where a record that cannot be shown is named
        self.where: dict[int, str] = {}

    def skip(self, entry: dict[str, Any], why: str) -> None:
        """Count and name a record that was read but cannot be shown."""
        self.damaged.append(f"{self.where.get(id(entry), '?')}: {why}")


def scan(path: str) -> Scan:
    """Every readable record under a GCPATCH_RECORD directory (or in one JSONL file), grouped by
    rank, then by run (a process: its pid, in the order runs started), then by time."""
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
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                found.damaged.append(f"{name}:{number}: not a JSON record ({type(exc).__name__})")
                found.torn += raw.lstrip().startswith(b"{")
                continue
            if not isinstance(entry, dict):
                kind = type(entry).__name__
                found.damaged.append(f"{name}:{number}: a JSON {kind}, not a record")
                continue
            found.entries.append(entry)
            found.where[id(entry)] = f"{name}:{number}"
    found.entries = _by_run(found.entries)
    return found


def read(path: str) -> list[dict[str, Any]]:
    """The readable records under `path` (see `scan`)."""
    return scan(path).entries


def _by_run(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank, then run (its first line's time), then time: concurrent runs writing into one
    directory interleave their lines, and each run is shown whole."""
    started: dict[tuple[str, str], float] = {}
    for entry in entries:
        key = (_key(entry.get("rank")), _key(entry.get("pid")))
        started[key] = min(started.get(key, math.inf), _number(entry.get("time")))
    return sorted(
        entries,
        key=lambda e: (
            _number(e.get("rank")),
            started[(_key(e.get("rank")), _key(e.get("pid")))],
            _key(e.get("pid")),
            _number(e.get("time")),
        ),
    )


def _key(value: Any) -> str:
    """A rank or a pid as text: what a record holds there, or `?` for what is no single value."""
    if value is None or isinstance(value, (dict, list)):
        return "?"
    return str(value)


def _number(value: Any) -> float:
    """A finite number, or 0: a record may hold anything in its numeric fields."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value) if abs(value) < 1e300 else math.inf
        return number if math.isfinite(number) else 0.0
    return 0.0


def main(path: str | None, verbose: bool) -> int:
    """Print the record under `path` (exit 0), or say why it cannot (exit 2)."""
    if not path:
        _err("gcpatch explain: no records; run with GCPATCH_RECORD=<dir> and pass that directory")
        return 2
    if not os.path.exists(path):
        _err(f"gcpatch explain: {path} does not exist; pass the GCPATCH_RECORD directory")
        return 2
    found = scan(path)
    if not found.entries and not found.damaged:
        _out(f"gcpatch explain: no decisions recorded under {path}")
        return 0
    readable = [e for e in found.entries if isinstance(e.get("stage"), str)]
    if not readable and (found.entries or not found.torn):
        _err(
            f"gcpatch explain: {path} is not a gcpatch record (no line of it is a decision); pass"
            " the GCPATCH_RECORD directory or one of its gcpatch-rank<N>.jsonl files"
        )
        return 2
    for entry in found.entries:
        if not isinstance(entry.get("stage"), str):
            found.skip(entry, "a JSON object without a stage, not a decision record")
    for text in _lines(readable, verbose, found):
        _out(text)
    _report_skipped(found, bool(readable))
    return 0


def _report_skipped(found: Scan, any_shown: bool) -> None:
    """The count of the lines not shown, each named with its file, line and why."""
    if not found.damaged:
        return
    what = "every line" if not any_shown else f"{len(found.damaged)} damaged line(s)"
    cause = " (a rank killed mid-write leaves a truncated line)" if found.torn else ""
    _err(f"gcpatch explain: skipped {what}{cause}:")
    for where in found.damaged[:_DAMAGED_SHOWN]:
        _err(f"    {where}")
    if len(found.damaged) > _DAMAGED_SHOWN:
        _err(f"    (+{len(found.damaged) - _DAMAGED_SHOWN} more)")


def _lines(entries: list[dict[str, Any]], verbose: bool, found: Scan) -> list[str]:
    """Each record's lines, by rank and run; a record that cannot be shown is `found.skip`ped."""
    several_runs = len({_key(e.get("pid")) for e in entries}) > len(
        {_key(e.get("rank")) for e in entries}
    )
    by_rank: dict[str, list[str]] = {}
    last_run: dict[str, str] = {}
    for entry in entries:
        try:
            shown = entry_lines(entry, verbose)
        except Exception as exc:  # noqa: BLE001 (one record's shape never stops the reading: named)
            found.skip(entry, f"cannot be shown ({type(exc).__name__}: {exc})")
            continue
        rank = _key(entry.get("rank"))
        lines = by_rank.setdefault(rank, [])
        run = _key(entry.get("pid"))
        if several_runs and last_run.get(rank) != run:
            lines.append(f"-- run: pid {run}, started {_when(entry.get('time'))}")
        last_run[rank] = run
        lines.extend(shown)
    out: list[str] = []
    first = next(iter(by_rank), None)
    for rank, lines in by_rank.items():
        if len(by_rank) > 1:
            if rank != first and lines == by_rank[first]:
                out.append(f"rank {rank}: the same {len(lines)} line(s) as rank {first}")
                continue
            out.append(f"rank {rank}:")
        out.extend(lines)
    return out


def _when(stamp: object) -> str:
    number = _number(stamp)
    if not number:
        return "?"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(number))
    except (OverflowError, OSError, ValueError):
        return "?"


def _missing_fields(entry: dict) -> list[str]:
    """The fields a record lacks (or holds with the wrong type), named for the reader."""
    if "failed_open" in entry:
        return [k for k in ("rank", "stage") if k not in entry]
    fields = _CALL_FIELDS if entry.get("stage") == "call" else _DECISION_FIELDS
    missing = [k for k, kind in fields.items() if not isinstance(entry.get(k), kind)]
    if isinstance(entry.get("asked"), dict):
        missing += [f"asked.{k}" for k in ("use_reentrant", "from") if k not in entry["asked"]]
    if isinstance(entry.get("decision"), dict):
        missing += [
            f"decision.{k}"
            for k, kind in _DETAIL_FIELDS.items()
            if not isinstance(entry["decision"].get(k), kind)
        ]
    return missing


def entry_lines(entry: dict, verbose: bool) -> list[str]:
    """One whole line per record (gcpatch/headline.py); with `verbose`, the detail line, every
    vote that won or lost, the warnings and the facts."""
    from gcpatch import headline

    if entry.get("stage") == "repeat":
        of = entry.get("of") if isinstance(entry.get("of"), dict) else {}
        who = of.get("model") or of.get("site") or "?"
        return [
            f"gcpatch: rank {entry.get('rank', '?')} {who}: the same {of.get('stage', '?')}"
            f" {_number(entry.get('repeats')):.0f} time(s) more"
        ]
    if isinstance(entry.get("line"), str):  # a verify result, a crash note: its own text
        details = entry.get("details")
        details = details if isinstance(details, (list, tuple)) else ()
        return [entry["line"]] + [f"    {text}" for text in details if isinstance(text, str)]
    missing = _missing_fields(entry)
    if missing:
        return [
            f"gcpatch: rank {entry.get('rank', '?')} {entry.get('stage', '?')}: incomplete record, "
            f"missing {', '.join(missing)}"
        ]
    out = [headline.line(entry, limit=None)]  # whole: explain has no terminal row to fit
    if not verbose or "failed_open" in entry:
        return out
    out.append("    " + headline.detail(entry))
    decision = entry["decision"]
    for knob, vote in decision["winners"].items():
        vote = vote if isinstance(vote, dict) else {}
        if knob in entry["applied"]:
            out.append(
                f"    {knob} = {vote.get('value')!r:6} by {vote.get('rule', '?')}"
                f" ({vote.get('strength', '?')}): {vote.get('reason', '')}"
            )
        else:
            out.append(
                f"    {knob}: not needed with this choice ({vote.get('rule', '?')} voted"
                f" {vote.get('value')!r})"
            )
    for vote in decision["overruled"]:
        vote = vote if isinstance(vote, dict) else {}
        out.append(
            f"    overruled: {vote.get('rule', '?')} ({vote.get('strength', '?')}) wanted "
            f"{vote.get('knob', '?')}={vote.get('value')!r}"
        )
    for text in decision["warnings"] + decision["conflicts"]:
        out.append(f"    warning: {text}")
    if isinstance(entry.get("facts"), dict):
        for key, value in entry["facts"].items():
            if key == "versions" and isinstance(value, dict):
                out.append(f"      fact versions = {_versions(value)}")
            else:
                out.append(f"      fact {key} = {value!r}")
    return out


def _versions(found: dict) -> str:
    """The frameworks the process had imported, with their versions; a framework installed but
    not imported (trl under a plain Trainer) was not in use, so it has none."""
    used = [f"{name} {version}" for name, version in found.items() if version]
    idle = [str(name) for name, version in found.items() if not version]
    return ", ".join(used) + (f" (not imported: {', '.join(idle)})" if idle else "")


def _out(text: str) -> None:
    _print(text, sys.stdout)


def _err(text: str) -> None:
    _print(text, sys.stderr)


def _print(text: str, stream: Any) -> None:
    """One line, whatever it holds: a path that was not valid UTF-8 comes back from JSON as lone
    surrogates, which a UTF-8 console cannot encode; they are shown escaped."""
    try:
        print(text, file=stream)
    except UnicodeEncodeError:
        encoding = getattr(stream, "encoding", None) or "utf-8"
        print(text.encode(encoding, "backslashreplace").decode(encoding, "replace"), file=stream)
