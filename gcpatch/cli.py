"""The `gcpatch` command: `doctor`, `explain`, `rules`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a reader that stopped early (`| head`) raises here
        return code
    except BrokenPipeError:
        # The reader has what it wanted: no traceback, and no second error when Python flushes
        # stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="gcpatch", description="Correct gradient checkpointing, explained."
    )
    parser.add_argument("--version", action="version", version=f"gcpatch {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser(
        "doctor", help="versions, plugins loaded or skipped and why, live patch points, mode"
    )
    doctor.add_argument(
        "--no-import",
        action="store_true",
        help="do not import the frameworks to check that the patch points resolve",
    )
    explain = sub.add_parser("explain", help="the recorded decisions, per rank")
    explain.add_argument(
        "path",
        nargs="?",
        default=os.environ.get("GCPATCH_RECORD"),
        help="a GCPATCH_RECORD directory or one JSONL file (default: $GCPATCH_RECORD)",
    )
    explain.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print what was asked, every vote, the warnings and the facts",
    )
    rules = sub.add_parser("rules", help="the rule table of every active plugin")
    rules.add_argument(
        "--markdown",
        action="store_true",
        help="every built-in plugin's rules as the markdown of docs/RULES.md, installed or not",
    )
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return _doctor(not args.no_import)
    if args.command == "explain":
        return _explain(args.path, args.verbose)
    return _rules_markdown() if args.markdown else _rules()


def _doctor(import_frameworks: bool) -> int:
    from gcpatch import activation, engine, facts, settings

    cfg = settings.read()
    print(f"gcpatch {_version()}  python {sys.version.split()[0]}")
    print(
        f"mode: {cfg.mode}   GCPATCH={activation.ENV_AT_START or '(unset)'}   record:"
        f" {cfg.record_dir or '(off)'}   blocked:"
        f" {', '.join(sorted(cfg.blocked_plugins)) or '(none)'}"
    )
    print(
        "installed: "
        + ", ".join(f"{k} {facts.installed_version(k) or '-'}" for k in facts.VERSIONED)
    )
    host = engine.start()
    if import_frameworks:
        for status in host.active():
            for point in status.patch_points:
                try:
                    importlib.import_module(point.module)
                except Exception as exc:  # noqa: BLE001
                    print(f"  cannot import {point.module}: {type(exc).__name__}: {exc}")
    patcher = engine.patcher()
    for text in engine.reinstate():
        print(f"rebound by another tool: {text}")
    print("plugins:")
    for status in host.statuses:
        info = status.info
        where = (
            f" {info.framework} {status.framework_version or '-'} (supports {info.versions})"
            if info
            else ""
        )
        if info and info.proven:
            verdict = (
                ("UNTESTED release" if status.untested else "in range")
                if status.state == "active"
                else ""
            )
            where += f" proven {info.proven}" + (f": {verdict}" if verdict else "")
        print(f"  {status.name}: {status.state}{where}{' - ' + status.why if status.why else ''}")
        for point in status.patch_points:
            key = (point.module, point.target)
            if patcher is not None and key in patcher.installed:
                state = "live"
            elif patcher is not None and key in patcher.not_applicable:
                state = "not in this version"
            else:
                state = "waiting for import" if point.module not in sys.modules else "not installed"
            print(f"    {point.module}.{point.target}: {state}  ({point.why})")
    return 0


def _explain(path: str | None, verbose: bool) -> int:
    from gcpatch import record

    if not path or not os.path.exists(path):
        print(
            "gcpatch explain: no records; run with GCPATCH_RECORD=<dir> and pass that directory",
            file=sys.stderr,
        )
        return 2
    found = record.scan(path)
    if not found.entries and not found.damaged:
        print(f"gcpatch explain: no decisions recorded under {path}")
        return 0
    if not any(isinstance(entry.get("stage"), str) for entry in found.entries):
        print(
            f"gcpatch explain: {path} is not a gcpatch record (no line of it is a decision); pass"
            " the GCPATCH_RECORD directory or one of its gcpatch-rank<N>.jsonl files",
            file=sys.stderr,
        )
        return 2
    # two runs in one directory: each rank's lines of a run start with its pid and start time
    several_runs = len({str(e.get("pid", "?")) for e in found.entries}) > len(
        {str(e.get("rank", "?")) for e in found.entries}
    )
    by_rank: dict[str, list[str]] = {}
    last_run: dict[str, str] = {}
    for entry in found.entries:
        rank_ = str(entry.get("rank", "?"))
        lines = by_rank.setdefault(rank_, [])
        run = str(entry.get("pid", "?"))
        if several_runs and last_run.get(rank_) != run:
            lines.append(f"-- run: pid {run}, started {_when(entry.get('time'))}")
        last_run[rank_] = run
        lines.extend(_explain_lines(entry, verbose))
    first = next(iter(by_rank), None)
    for rank_, lines in by_rank.items():
        if len(by_rank) > 1:
            if rank_ != first and lines == by_rank[first]:
                print(f"rank {rank_}: the same {len(lines)} line(s) as rank {first}")
                continue
            print(f"rank {rank_}:")
        for text in lines:
            print(text)
    if found.damaged:
        print(
            f"gcpatch explain: skipped {len(found.damaged)} damaged line(s) "
            "(a rank killed mid-write leaves a truncated line):",
            file=sys.stderr,
        )
        for where in found.damaged[:20]:
            print(f"    {where}", file=sys.stderr)
    return 0


def _when(stamp: object) -> str:
    if isinstance(stamp, (int, float)) and not isinstance(stamp, bool):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
    return "?"


# What `summary` and the detail lines read from a decision record, and their types.
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


def _explain_lines(entry: dict, verbose: bool) -> list[str]:
    """One short line per decision (gcpatch/headline.py); with `verbose`, the detail line, every
    vote that won or lost, the warnings and the facts."""
    from gcpatch import headline

    if "line" in entry:  # a verify result or a crash explanation carries its own text
        return [entry["line"]] + [f"    {text}" for text in entry.get("details", ())]
    missing = _missing_fields(entry)
    if missing:
        return [
            f"gcpatch: rank {entry.get('rank', '?')} {entry.get('stage', '?')}: incomplete record, "
            f"missing {', '.join(missing)}"
        ]
    out = [headline.line(entry)]
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
            out.append(f"      fact {key} = {value!r}")
    return out


def _rules() -> int:
    from gcpatch import engine

    host = engine.start()
    print(
        f"{'id':<8} {'plugin':<14} {'versions':<10} rule (source); [documents]: never decides a"
        " knob"
    )
    table = host.rules()
    for plugin, rule in table:
        kind = "[documents] " if rule.documents else ""
        print(
            f"{rule.id:<8} {plugin:<14} {rule.versions:<10} {kind}{rule.summary}\n{'':<34}source:"
            f" {rule.source}"
        )
    if not table:
        why = "; ".join(
            f"{s.name}: {s.state}{' (' + s.why + ')' if s.why else ''}" for s in host.statuses
        )
        print(
            f"gcpatch rules: no rule applies here, no plugin is active ({why or 'none installed'});"
            " `gcpatch rules --markdown` prints every built-in rule",
            file=sys.stderr,
        )
    return 0


def _rules_markdown() -> int:
    """docs/RULES.md: generated from the plugins' own tables, so it cannot drift from the code."""
    from gcpatch import manager

    print("# gcpatch rules\n")
    print(
        "Generated by `gcpatch rules --markdown > docs/RULES.md` from each built-in plugin's rule"
        " table (`gcpatch_plugin_info`); `tests/docs/test_rules_doc.py` fails when it is out of"
        " date."
        " *decides*: the rule votes on a knob; *documents*: it records upstream behaviour or a"
        " patch point and never votes.\n"
    )
    for name, info in manager.builtin_infos():
        print(f"## {name} ({info.framework} {info.versions})\n")
        print("| id | kind | versions | rule | source |\n| --- | --- | --- | --- | --- |")
        for rule in info.rules:
            cells = [
                rule.id,
                "documents" if rule.documents else "decides",
                rule.versions,
                rule.summary,
                rule.source,
            ]
            print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        print()
    return 0


def _version() -> str:
    from gcpatch import __version__

    return __version__


if __name__ == "__main__":
    raise SystemExit(main())
