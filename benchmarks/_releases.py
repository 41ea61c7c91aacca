"""What the per-release benchmarks (compile_cost.py, import_cost.py) share: fresh interpreters of
a venv given on the command line (one venv per transformers release), and results kept per release
in a JSON file from which the markdown table is regenerated (`--table-only` rewrites it alone)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from testkit import harness


def child_env(gcpatch: bool, **extra: str) -> dict[str, str]:
    """The environment of every child (tests/kit/testkit/harness.py: no caller GCPATCH*, offline,
    quiet), one OpenMP thread (a benchmark times: the harness leaves threads to the caller), with
    gcpatch switched on or off."""
    return harness.child_env(
        quiet=True, GCPATCH="1" if gcpatch else "0", **{"OMP_NUM_THREADS": "1", **extra}
    )


def run_worker(
    python: str, code: str, args: list[str], env: dict[str, str], timeout: float = 1200
) -> dict[str, Any]:
    """One fresh interpreter of `python` running `code` (a worker printing `RESULT {json}`) with
    `args`, from the benchmarks folder; its RESULT, or an error with the end of its stderr."""
    proc = subprocess.run(
        [python, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parent,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{code.strip()[:40]!r} {args} failed:\n{proc.stderr[-3000:]}")
    return harness.result_of(proc)


def release(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True,
        text=True,
        env=child_env(False),
        check=True,
    ).stdout.strip()


def main(
    parser: argparse.ArgumentParser,
    measure: Callable[[str, argparse.Namespace], dict[str, Any]],
    table: Callable[[dict], str],
    results_path: Path,
    table_path: Path,
) -> None:
    """Measure each `--python` (default: this interpreter), merge into `results_path` under its
    transformers release (keys this run does not measure are kept), and write the table generated
    from all releases measured so far."""
    parser.add_argument(
        "--python", action="append", help="a venv's interpreter (repeat: one per release)"
    )
    parser.add_argument(
        "--table-only", action="store_true", help="regenerate the table from the JSON"
    )
    args = parser.parse_args()
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if not args.table_only:
        for python in args.python or [sys.executable]:
            name = release(python)
            print(f"{python}: transformers {name}", file=sys.stderr)
            results[name] = {  # what this run did not measure stays as it was
                **results.get(name, {}),
                **measure(python, args),
                "when": time.strftime("%Y-%m-%d %H:%M"),
                "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
            }
        results_path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    table_path.write_text(table(results))
    print(table_path.read_text())
