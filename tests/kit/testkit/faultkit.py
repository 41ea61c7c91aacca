"""The reliability suite's tools: install the misbehaving plugin (tests/kit/testkit/faults/plugin.py) as a
real distribution, run user code in a fresh interpreter or under torchrun, and tally what the
suite tried (`tests/kit/testkit/reliability_table.py` turns the tally into docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from testkit import harness
from testkit.harness import child_env, parse_results, run_python, torchrun_argv

FAULTS = Path(__file__).resolve().parent / "faults"
TALLY_ENV = "GCPATCH_RELIABILITY_TALLY"  # a JSONL file; unset: nothing is tallied

TARGET = """
CALLS = []


def work(x):
    CALLS.append(x)
    return x + 1
"""


def install_fault_plugin(site: Path) -> str:
    """A `faulty` plugin distribution under `site` (put it on PYTHONPATH); returns the path."""
    info = site / "faulty_plugin-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (site / "faulty_plugin.py").write_text((FAULTS / "plugin.py").read_text())
    (site / "faulty_target.py").write_text(TARGET)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faulty-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[gcpatch.plugins]\nfaulty = faulty_plugin\n")
    return str(site)


def run(code: str, cwd: Path, args: list[str] | None = None, timeout: float = 240, **env: str):
    """`code` in a fresh interpreter of this venv (the INSTALLED gcpatch), cwd `cwd`; a hang
    shows as returncode None (harness.run), for the tally."""
    return run_python(code, cwd, args, timeout, **env)


def torchrun(script: Path, nproc: int, cwd: Path, timeout: float = 240, **env: str):
    """`script` under torch.distributed.run, gloo on CPU; a hang shows as returncode None."""
    return harness.run(
        torchrun_argv(nproc, str(script)), cwd, child_env(quiet=True, **env), timeout
    )


def results(proc) -> list[dict]:
    """Every RESULT of a single-process run."""
    return parse_results(proc.stdout or "")


def rank_results(directory: Path) -> list[dict]:
    """The rank<N>.json files a torchrun script wrote, by rank."""
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank*.json"))]


def tally(area: str, case: str, survived: bool, clear: bool, lost: bool) -> None:
    """One try of the suite: did the host survive (or stop with gcpatch's one clear error where
    that is the point), was the message clear, was any data lost or foreign file written."""
    path = os.environ.get(TALLY_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(
                json.dumps(
                    {"area": area, "case": case, "survived": survived, "clear": clear, "lost": lost}
                )
                + "\n"
            )
