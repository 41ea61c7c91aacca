"""What `.ci/run` says while it runs and when it ends, read from the status file each env's pytest
writes (.ci/run_pytest.py, into $GCPATCH_CI_STATUS):

    python .ci/progress.py STATUS_DIR START ENV...           one progress line
    python .ci/progress.py --final STATUS_DIR START ENV...   per env: counts; then every skip reason

An env with no status file yet is still setting up (tox installs its packages first); one whose
tox run has no pytest (lint) is said so. Standard library only: it runs on the bare python3.11.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

COUNTS = ("passed", "failed", "errors", "skipped", "xfailed")


def _status(folder: Path, env: str) -> dict | None:
    try:
        return json.loads((folder / f"{env}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # not started its tests yet (or mid-write: the next line reads it)


def _counts(status: dict) -> str:
    return ", ".join(f"{status.get(k, 0)} {k}" for k in COUNTS if status.get(k) or k == "passed")


def progress(folder: Path, start: float, envs: list[str]) -> str:
    parts = []
    for env in envs:
        status = _status(folder, env)
        if status is None:
            parts.append(f"{env} not in pytest yet")
        elif status.get("state") == "done":
            parts.append(f"{env} done ({_counts(status)})")
        else:
            failed = status.get("failed", 0) + status.get("errors", 0)
            parts.append(
                f"{env} {status.get('done', 0)}/{status.get('total', '?')}"
                + (f" ({failed} failed)" if failed else "")
            )
    minutes, seconds = divmod(int(time.time() - start), 60)
    return f"[{minutes:02d}:{seconds:02d}] " + "; ".join(parts)


def final(folder: Path, start: float, envs: list[str]) -> str:
    lines = [f"{'env':<12} {'tests':<8} " + " ".join(f"{k:>8}" for k in COUNTS) + "  seconds"]
    reasons: dict[str, list[str]] = defaultdict(list)
    for env in envs:
        status = _status(folder, env)
        if status is None:
            lines.append(f"{env:<12} {'none':<8} (no pytest ran: see tox's line for this env)")
            continue
        verdict = "FAILED" if status.get("failed") or status.get("errors") else "ok"
        if status.get("state") != "done":
            verdict = "STOPPED"
        lines.append(
            f"{env:<12} {verdict:<8} "
            + " ".join(f"{status.get(k, 0):>8}" for k in COUNTS)
            + f"  {status.get('seconds', 0):>7.0f}"
        )
        for reason in status.get("skips", []):
            reasons[reason].append(env)
    if reasons:
        lines.append(f"skipped ({sum(len(v) for v in reasons.values())}), by reason:")
        for reason, where in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
            counted = ", ".join(f"{env} x{where.count(env)}" for env in dict.fromkeys(where))
            lines.append(f"  {reason}  [{counted}]")
    else:
        lines.append("skipped: none")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    last = argv[0] == "--final"
    folder, start, *envs = argv[1:] if last else argv
    text = (final if last else progress)(Path(folder), float(start), envs)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
