"""Regenerate docs/RELIABILITY.md: run the reliability suite with a tally file and count, per
area, the tries, how many the host survived, how many gave the one clear message expected, and
how many lost data (wrong or missing gradients, lost records, a foreign file written).

usage: python tests/kit/testkit/reliability_table.py [--out FILE] [pytest args, e.g. -m "not distributed"]
(against the INSTALLED gcpatch, like the rest of the suite)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import OrderedDict
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # tests/kit/testkit/<this file>: the repository
FILES = [
    "tests/process/test_reliability_plugins.py",
    "tests/process/test_reliability_record.py",
    "tests/process/test_reliability_env.py",
    "tests/unit/test_reliability_resolve.py",
    "tests/process/test_reliability_ordering.py",
    "tests/process/test_reliability_ranks.py",
]
OUT = ROOT / "docs" / "RELIABILITY.md"


def main(argv: list[str]) -> int:
    out = OUT
    if argv[:1] == ["--out"]:
        out, argv = Path(argv[1]).resolve(), argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        tally = Path(tmp) / "tally.jsonl"
        env = {**os.environ, "GCPATCH_RELIABILITY_TALLY": str(tally)}
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES, *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        rows = (
            [json.loads(line) for line in tally.read_text().splitlines()] if tally.exists() else []
        )
    summary = (proc.stdout.strip().splitlines() or ["(no pytest output)"])[-1]
    areas: OrderedDict[str, list[int]] = OrderedDict()
    for row in rows:
        counts = areas.setdefault(row["area"], [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += row["survived"]
        counts[2] += row["clear"]
        counts[3] += row["lost"]
    total = [sum(c[i] for c in areas.values()) for i in range(4)]
    versions = ", ".join(f"{d} {_version(d)}" for d in ("torch", "transformers", "peft"))
    lines = [
        "# Reliability suite",
        "",
        "gcpatch runs inside other people's jobs. This suite injects faults and bad input and counts, for",
        "every try, whether the host job survived (trained on, or stopped with gcpatch's one clear error",
        "where that is the point: strict mode, ranks that would split), whether the one expected line or",
        "error appeared, and whether anything was lost (wrong or missing gradients, a lost record, a",
        "file outside the record written). Regenerate with `python tests/kit/testkit/reliability_table.py`.",
        "",
        "| area | tries | survived | clear message | data lost |",
        "|---|---|---|---|---|",
        *(f"| {area} | {c[0]} | {c[1]} | {c[2]} | {c[3]} |" for area, c in areas.items()),
        f"| **total** | **{total[0]}** | **{total[1]}** | **{total[2]}** | **{total[3]}** |",
        "",
        f"pytest: `{summary}` ({versions}, Python {sys.version.split()[0]}).",
        "",
        "Multi-rank tries (torchrun, gloo on CPU, the fault on rank 1 only):",
        "",
        "| case | no hang, every rank finished | one consistent outcome, clearly said | data lost |",
        "|---|---|---|---|",
        *(
            f"| {r['case']} | {_yes(r['survived'])} | {_yes(r['clear'])} | {_yes(r['lost'])} |"
            for r in rows
            if r["area"] == "ranks"
        ),
        "",
        "Where: `tests/process/test_reliability_*.py` and `tests/unit/test_reliability_resolve.py`; the misbehaving plugin is `tests/kit/testkit/faults/plugin.py`.",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return proc.returncode


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
