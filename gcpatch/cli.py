"""The `gcpatch` command: `doctor`, `explain`, `rules`."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gcpatch", description="Correct gradient checkpointing, explained.")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="versions, plugins loaded or skipped and why, live patch points, mode")
    doctor.add_argument("--no-import", action="store_true",
                        help="do not import the frameworks to check that the patch points resolve")
    explain = sub.add_parser("explain", help="the recorded decisions, per rank")
    explain.add_argument("path", nargs="?", default=os.environ.get("GCPATCH_RECORD"),
                         help="a GCPATCH_RECORD directory or one JSONL file (default: $GCPATCH_RECORD)")
    explain.add_argument("-v", "--verbose", action="store_true", help="also print every vote and the facts")
    sub.add_parser("rules", help="the rule table of every active plugin")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return _doctor(not args.no_import)
    if args.command == "explain":
        return _explain(args.path, args.verbose)
    return _rules()


def _doctor(import_frameworks: bool) -> int:
    from gcpatch import activation, engine, facts, settings

    cfg = settings.read()
    print(f"gcpatch {_version()}  python {sys.version.split()[0]}")
    print(f"mode: {cfg.mode}   GCPATCH={activation.ENV_AT_START or '(unset)'}   "
          f"record: {cfg.record_dir or '(off)'}   blocked: {', '.join(sorted(cfg.blocked_plugins)) or '(none)'}")
    print("installed: " + ", ".join(f"{k} {facts.installed_version(k) or '-'}" for k in facts.VERSIONED))
    host = engine.start()
    if import_frameworks:
        for status in host.active():
            for point in status.patch_points:
                try:
                    importlib.import_module(point.module)
                except Exception as exc:  # noqa: BLE001
                    print(f"  cannot import {point.module}: {type(exc).__name__}: {exc}")
    patcher = engine.patcher()
    print("plugins:")
    for status in host.statuses:
        info = status.info
        where = f" {info.framework} {status.framework_version or '-'} (supports {info.versions})" if info else ""
        if info and info.proven:
            verdict = ("UNTESTED release" if status.untested else "in range") if status.state == "active" else ""
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
        print("gcpatch explain: no records; run with GCPATCH_RECORD=<dir> and pass that directory", file=sys.stderr)
        return 2
    entries = record.read(path)
    if not entries:
        print(f"gcpatch explain: no decisions recorded under {path}")
        return 0
    for entry in entries:
        print(record.summary(entry))
        if "failed_open" in entry:
            continue
        decision = entry["decision"]
        for knob, vote in decision["winners"].items():
            if knob in entry["applied"]:
                print(f"    {knob} = {vote['value']!r:6} by {vote['rule']} ({vote['strength']}): {vote['reason']}")
            else:
                print(f"    {knob}: not needed with this choice ({vote['rule']} voted {vote['value']!r})")
        for vote in decision["overruled"]:
            print(f"    overruled: {vote['rule']} ({vote['strength']}) wanted {vote['knob']}={vote['value']!r}")
        for text in decision["warnings"] + decision["conflicts"]:
            print(f"    warning: {text}")
        if verbose:
            for key, value in entry["facts"].items():
                print(f"      fact {key} = {value!r}")
    return 0


def _rules() -> int:
    from gcpatch import engine

    print(f"{'id':<8} {'plugin':<14} {'versions':<10} rule (source)")
    for plugin, rule in engine.start().rules():
        print(f"{rule.id:<8} {plugin:<14} {rule.versions:<10} {rule.summary}\n{'':<34}source: {rule.source}")
    return 0


def _version() -> str:
    from gcpatch import __version__

    return __version__


if __name__ == "__main__":
    raise SystemExit(main())
