"""Running the user scripts under integration/scripts/ as a user would: a fresh interpreter of
this venv (`sys.executable`), cwd a temporary directory (so the INSTALLED gcpatch is the one
that runs, never the checkout), HF_HUB_OFFLINE=1, and either GCPATCH=0 (the plain run) or
GCPATCH=1 with GCPATCH_RECORD=<dir>. Nothing here imports gcpatch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.version import Version

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMEOUT_S = 300

TRANSFORMERS = Version(metadata.version("transformers"))
V5 = TRANSFORMERS.major >= 5


@dataclass(frozen=True)
class Spec:
    """One script invocation: which script, which variant arguments, plain or with gcpatch."""

    script: str
    args: tuple[str, ...] = ()
    gcpatch: bool = True

    def plain(self) -> "Spec":
        return Spec(self.script, self.args, False)

    def label(self) -> str:
        return f"{self.script} {' '.join(self.args)} [{'GCPATCH=1' if self.gcpatch else 'GCPATCH=0'}]"


@dataclass
class Run:
    spec: Spec
    returncode: int
    stdout: str
    stderr: str
    record_dir: Path
    wall_s: float = 0.0
    result: dict = field(default_factory=dict)

    def gcpatch_lines(self) -> list[str]:
        """gcpatch's one-line decisions on stderr."""
        return [line for line in self.stderr.splitlines() if line.startswith("gcpatch: rank ")]

    def records(self) -> list[dict]:
        """Every JSONL record gcpatch wrote under GCPATCH_RECORD, in file order."""
        entries = []
        for path in sorted(self.record_dir.glob("*.jsonl")):
            entries.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
        return entries

    def explain(self) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gcpatch", "explain", str(self.record_dir)],
                              cwd=self.record_dir.parent, env=child_env(), capture_output=True, text=True,
                              timeout=120)

    def describe(self) -> str:
        return f"{self.spec.label()} rc={self.returncode} ({self.wall_s:.1f} s)\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-4000:]}"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCPATCH") and k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def run_script(spec: Spec, workdir: Path) -> Run:
    """Run one script in `workdir` (a fresh temporary directory) and parse its RESULT line.

    The plain run gets GCPATCH=0 *and* a GCPATCH_RECORD directory: nothing may be written there."""
    workdir.mkdir(parents=True, exist_ok=True)
    record_dir = workdir / "gcpatch-record"
    env = child_env(GCPATCH="1" if spec.gcpatch else "0", GCPATCH_RECORD=str(record_dir))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPTS / spec.script), *spec.args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    run = Run(spec, proc.returncode, proc.stdout, proc.stderr, record_dir, time.monotonic() - start)
    results = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode == 0 and len(results) == 1:
        run.result = json.loads(results[0])
    return run
