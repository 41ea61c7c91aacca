"""The reliability suite's tools: install the misbehaving plugin (tests/faults/plugin.py) as a
real distribution, run user code in a fresh interpreter or under torchrun, and tally what the
suite tried (`tests/reliability_table.py` turns the tally into docs/RELIABILITY.md)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from subproc import clean_env

FAULTS = Path(__file__).resolve().parent / "faults"
TALLY_ENV = "GCPATCH_RELIABILITY_TALLY"  # a JSONL file; unset: nothing is tallied

TARGET = '''
CALLS = []


def work(x):
    CALLS.append(x)
    return x + 1
'''


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
    """`code` in a fresh interpreter of this venv (the INSTALLED gcpatch), cwd `cwd`."""
    cmd = [sys.executable, *(args or []), "-c", textwrap.dedent(code)]
    try:
        return subprocess.run(cmd, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # a hang: keep what it printed before, for the tally
        return _timed_out(cmd, exc, timeout)


def torchrun(script: Path, nproc: int, cwd: Path, timeout: float = 240, **env: str):
    """`script` under `python -m torch.distributed.run`, gloo on CPU; a hang shows as a timeout
    (returncode None) instead of blocking the suite."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script)]
    full = clean_env(OMP_NUM_THREADS="1", **env)
    try:
        return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return _timed_out(cmd, exc, timeout)


def _timed_out(cmd, exc, timeout):
    """returncode None: the command hung and was killed after `timeout` seconds."""
    out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    return subprocess.CompletedProcess(cmd, None, out, err + f"\n[timed out after {timeout}s]")


def results(proc) -> list[dict]:
    """Every `RESULT {json}` line of a single-process run."""
    return [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def rank_results(directory: Path) -> list[dict]:
    """The rank<N>.json files a torchrun script wrote, by rank."""
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank*.json"))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tally(area: str, case: str, survived: bool, clear: bool, lost: bool) -> None:
    """One try of the suite: did the host survive (or stop with gcpatch's one clear error where
    that is the point), was the message clear, was any data lost or foreign file written."""
    path = os.environ.get(TALLY_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"area": area, "case": case, "survived": survived, "clear": clear,
                                     "lost": lost}) + "\n")
