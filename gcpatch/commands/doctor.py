"""`gcpatch doctor`: whether gcpatch will be on in a job started from this environment, and why;
the start-up hook; the variables; the plugins and their patch points.

The doctor's own process imported gcpatch (which switches it on there), so what a job would do is
read from GCPATCH as this process found it and from the site directories, where Python's `site`
module runs `gcpatch.pth` at every interpreter's start-up (not under `python -S`, and not from a
folder that is only on PYTHONPATH: Python runs .pth files of site directories only).
"""

from __future__ import annotations

import importlib
import os
import site
import sys

from gcpatch import activation, engine, facts, headline, settings

HOOK = "gcpatch.pth"


def main(import_frameworks: bool) -> int:
    cfg = settings.read()
    hooks, searched = startup_hooks()
    on, why = job_verdict(activation.ENV_AT_START, cfg.mode, hooks, searched)
    print(f"gcpatch {_version()}  python {sys.version.split()[0]}")
    print(headline.wrap(f"in a job started from this environment: {'ON' if on else 'OFF'} - {why}"))
    print(
        headline.wrap(
            "start-up hook: "
            + (
                ", ".join(hooks)
                if hooks
                else f"missing ({HOOK} is in none of {', '.join(searched) or 'no site directory'})"
            )
        )
    )
    if not on:
        unused = [f"{n}={os.environ[n]}" for n in settings.set_but_unused()]
        if unused:
            print(
                headline.wrap(
                    f"set while gcpatch is off, protecting nothing: {', '.join(unused)}"
                    " (they take effect with GCPATCH=1 or `import gcpatch`)"
                )
            )
    budget = os.environ.get("GCPATCH_MEMORY_BUDGET") if cfg.memory_budget is not None else None
    print(
        headline.wrap(
            f"mode: {cfg.mode}   record: {cfg.record_dir or '(off)'}   verify:"
            f" {'on' if cfg.verify else 'off'}   memory budget: {budget or '(none)'}   blocked:"
            f" {', '.join(sorted(cfg.blocked_plugins)) or '(none)'}"
        )
    )
    print(headline.wrap(f"variables gcpatch reads: {', '.join(settings.VARIABLES)}"))
    unknown = settings.unknown_names()
    if unknown:
        print(headline.wrap(f"set, but not gcpatch variables (ignored): {', '.join(unknown)}"))
    versions = ", ".join(f"{k} {facts.installed_version(k) or '-'}" for k in facts.VERSIONED)
    print(headline.wrap(f"installed: {versions}"))
    _plugins(import_frameworks, on)
    return 0


def startup_hooks() -> tuple[list[str], list[str]]:
    """gcpatch's start-up hook in this environment's site directories (found, searched)."""
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    searched = list(dict.fromkeys(os.path.realpath(d) for d in dirs))  # lib64 -> lib: one
    found = []
    for folder in searched:
        path = os.path.join(folder, HOOK)
        try:
            with open(path, encoding="utf-8") as f:
                if "_gcpatch_startup" in f.read():
                    found.append(path)
        except OSError:
            continue  # not there (the common case for all but one directory)
    return found, searched


def job_verdict(
    switch_raw: str | None, mode: str, hooks: list[str], searched: list[str]
) -> tuple[bool, str]:
    """Whether a job started from this environment, with this environment's variables, runs
    gcpatch without importing it; and the reason, with what to change."""
    switch = settings.switch(switch_raw)
    if switch is None:
        return False, (
            "GCPATCH is unset (set GCPATCH=1 for the job, or `import gcpatch` in the script)"
        )
    if switch is False:
        if switch_raw.strip().lower() in ("0", "false", "no", "off"):
            return False, f"GCPATCH={switch_raw} switches it off"
        return False, (
            f"GCPATCH={switch_raw!r} is not an on/off value ({settings.FLAG_RULE}), so gcpatch"
            " stays off"
        )
    if mode == "off":
        return False, "GCPATCH_MODE=off patches nothing"
    if not hooks:
        home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return False, (
            f"GCPATCH={switch_raw}, but the start-up hook is missing: gcpatch is imported from"
            f" {home}, which is not a site directory of this interpreter (PYTHONPATH or a source"
            " tree), and Python runs no .pth file there. Install gcpatch into the environment"
            " (`pip install`), or `import gcpatch` in the script"
        )
    return True, (
        f"GCPATCH={switch_raw} and the start-up hook: every interpreter of this environment"
        " (torchrun, accelerate and deepspeed ranks too; not `python -S`)"
    )


def _plugins(import_frameworks: bool, on: bool) -> None:
    host = engine.start()
    if import_frameworks:
        for status in host.active():
            for point in status.patch_points:
                try:
                    importlib.import_module(point.module)
                except Exception as exc:  # noqa: BLE001 (a report line: the import is the finding)
                    print(f"  cannot import {point.module}: {type(exc).__name__}: {exc}")
    patcher = engine.patcher()
    for text in engine.reinstate():
        print(f"rebound by another tool: {text}")
    print(
        "plugins:"
        if on
        else "plugins (loaded here to check them; a job patches nothing while gcpatch is off):"
    )
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
        if status.state == "failed" and status.why.startswith("did not import within"):
            # gcpatch/manager.py `_loaded`: every checkpointing process waits for it that long
            print(
                "    every checkpointing job waits that long for it (GCPATCH_PLUGIN_TIMEOUT_S);"
                f" GCPATCH_DISABLE_PLUGINS={status.name} blocks it"
            )
        for point in status.patch_points:
            key = (point.module, point.target)
            if patcher is not None and key in patcher.installed:
                state = "live"
            elif patcher is not None and key in patcher.not_applicable:
                # the point's own `applies` said no: the plugin's other points serve this release
                release = f" {info.framework} {status.framework_version}" if info else ""
                state = f"not needed on{release or ' this release'}"
            else:
                state = "waiting for import" if point.module not in sys.modules else "not installed"
            print(f"    {point.module}.{point.target}: {state}  ({point.why})")


def _version() -> str:
    from gcpatch import __version__

    return __version__
