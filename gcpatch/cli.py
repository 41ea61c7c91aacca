"""The `gcpatch` command: `doctor`, `explain`, `rules`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
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
        from gcpatch import explain

        return explain.main(args.path, args.verbose)
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
