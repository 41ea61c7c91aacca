"""Warm starts: a user script run in a fork of an interpreter of this venv that has already imported
the frameworks (tests/kit/testkit/warm/server.py), instead of in a fresh interpreter that imports them again.

Importing torch, transformers and peft costs a script about 5 s of CPU, most of what a tiny run
costs; the integration suite runs hundreds of them. A child of the warm interpreter starts from the
state a fresh `python script.py` with the same environment reaches after those imports, gcpatch
included: the start-up file ran and gcpatch armed its patch points at the import of torch in the
warm interpreter, as it would in the script; the plugins load, and the settings that only a decision
reads are read, in the child at the first checkpointing call.

`python script.py` runs in a child directly; under `python -m torch.distributed.run` torchrun itself
starts fresh and launches its ranks as usual (`--no-python`, tests/kit/testkit/warm/rank.py), each rank a child
with the environment torchrun gave it. One warm interpreter serves every run whose environment
agrees with it in all but `PER_RUN`. Runs it cannot serve as faithfully start fresh: other launchers,
interpreter flags, a run without GCPATCH in its environment (a script that activates gcpatch itself by
`import gcpatch`, where the import order is the subject). GCPATCH_TEST_WARM=0 starts every run fresh.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent / "warm"
SERVER, RANK = HERE / "server.py", HERE / "rank.py"
TORCHRUN = ("-m", "torch.distributed.run")
# Variables whose value nothing uses before the script's own first call: gcpatch's record folder, verify,
# memory budget and local plugins (used from the first checkpointing call on: engine._load, pipeline,
# verify, planner; at import gcpatch uses only GCPATCH, GCPATCH_MODE and GCPATCH_DISABLE_PLUGINS,
# engine.arm) and the rendezvous port (init_process_group). Runs that differ only in these share a warm
# interpreter, whose environment lacks them.
PER_RUN = frozenset(
    {
        "GCPATCH_RECORD",
        "GCPATCH_VERIFY",
        "GCPATCH_MEMORY_BUDGET",
        "GCPATCH_LOCAL_PLUGINS",
        "MASTER_PORT",
    }
)


def enabled() -> bool:
    return os.environ.get("GCPATCH_TEST_WARM", "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


def _script_at(argv: list[str]) -> int | None:
    """Where the script is in a servable command line: `python script.py ...` or `python -m
    torch.distributed.run --opt=value ... script.py ...`."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    at = 1
    if tuple(argv[1:3]) == TORCHRUN:
        at = 3
        while at < len(argv) and argv[at].startswith("--") and "=" in argv[at]:
            at += 1
    return (
        at if at < len(argv) and argv[at].endswith(".py") and not argv[at].startswith("-") else None
    )


def under_torchrun(argv: list[str]) -> bool:
    return tuple(argv[1:3]) == TORCHRUN


def servable(argv: list[str], env: dict[str, str]) -> bool:
    """A script of this venv's interpreter, plain or under torchrun, with GCPATCH set either way."""
    return _script_at(argv) is not None and "GCPATCH" in env


class WarmInterpreter:
    """One server process. Its stdin stays open as long as this process lives: when this process
    ends, the server sees EOF and stops with every child it still runs."""

    def __init__(self, env: dict[str, str]) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="gcpatch-warm-"))
        self.socket = str(self.home / "socket")
        self.log = self.home / "server.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(SERVER), self.socket],
                cwd=self.home,
                env=env,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=log,
            )
        self.users = 0  # runs holding it now (it is never closed under them)
        self.last_used = time.monotonic()

    @property
    def served(self) -> int:
        """Children started so far (the server writes a line for each)."""
        try:
            return sum(line.startswith(b"served ") for line in self.log.read_bytes().splitlines())
        except OSError:
            return 0

    def connect(self, deadline: float) -> socket.socket | None:
        """A connection once the server listens (it binds before importing anything)."""
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.socket)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    return None
                time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.home, ignore_errors=True)


# A warm interpreter holds about 360 MB of its own memory; past this many, the one idle longest is
# closed before another starts (the suite's common environments stay warm, rare ones come and go).
MAX_LIVE = 6
_servers: dict[tuple, WarmInterpreter] = {}
_servers_lock = threading.Lock()
_counts = {"started": 0, "served_by_closed": 0}


def _close_idle_beyond(limit: int) -> None:
    """Close the longest-idle servers until at most `limit` are live (the caller holds the lock)."""
    while len(_servers) > limit:
        idle = [(s.last_used, k) for k, s in _servers.items() if s.users == 0]
        if not idle:
            return
        server = _servers.pop(min(idle)[1])
        _counts["served_by_closed"] += server.served
        server.close()


@contextmanager
def _lease(env: dict[str, str]) -> Iterator[WarmInterpreter]:
    """The warm interpreter for this environment, started if need be, held for one run."""
    start_env = {k: v for k, v in env.items() if k not in PER_RUN}
    key = tuple(sorted(start_env.items()))
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and server.proc.poll() is not None:
            sys.stderr.write(
                f"warm start: a warm interpreter ended ({server.proc.returncode}); its log: "
                f"{server.log}\n"
            )
            del _servers[key]
            server = None
        if server is None:
            _close_idle_beyond(MAX_LIVE - 1)
            server = _servers[key] = WarmInterpreter(start_env)
            _counts["started"] += 1
        server.users += 1
    try:
        yield server
    finally:
        with _servers_lock:
            server.users -= 1
            server.last_used = time.monotonic()


@contextmanager
def torchrun_launch(argv: list[str], env: dict[str, str]) -> Iterator[list[str]]:
    """The same torchrun command with its ranks started warm: `--no-python python -u rank.py SOCKET
    script ...`, SOCKET the warm interpreter's for this environment."""
    at = _script_at(argv)
    assert at is not None and at > 1
    with _lease(env) as server:
        yield [
            *argv[:at],
            "--no-python",
            sys.executable,
            "-u",
            str(RANK),
            server.socket,
            *argv[at:],
        ]


def run(
    argv: list[str],
    cwd: Path | str,
    env: dict[str, str],
    timeout: float,
    kill: Callable[[int], None],
    mark: Mapping[str, str],
) -> subprocess.CompletedProcess | None:
    """Run `python script.py ...` in a child of a warm interpreter; None when none could take it
    (the caller then starts it fresh). `mark`: variables of this child alone (the harness's kill
    token), not of the interpreter that serves it. On a timeout `kill(pid)` stops the child and what
    it started, and the returncode is None, as for a fresh run."""
    with _lease(env) as server:
        return _run_in(server, argv, cwd, {**env, **mark}, timeout, kill)


def _run_in(
    server: WarmInterpreter,
    argv: list[str],
    cwd: Path | str,
    env: dict[str, str],
    timeout: float,
    kill: Callable[[int], None],
) -> subprocess.CompletedProcess | None:
    conn = server.connect(time.monotonic() + 120)
    if conn is None:
        sys.stderr.write(
            f"warm start: no warm interpreter for {argv[1]}, started fresh; its log: {server.log}\n"
        )
        return None
    with conn, tempfile.TemporaryDirectory(prefix="gcpatch-warm-run-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(os.devnull, "rb") as null, open(out, "wb") as o, open(err, "wb") as e:
            request = {"argv": argv, "cwd": str(cwd), "env": env, "unbuffered": False}
            socket.send_fds(
                conn, [json.dumps(request).encode()], [null.fileno(), o.fileno(), e.fileno()]
            )
        answers = conn.makefile("rb")
        deadline = time.monotonic() + timeout
        code, pid, note = None, None, ""
        try:
            conn.settimeout(timeout)
            line = answers.readline()
            if line:
                pid = json.loads(line)["pid"]
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                line = answers.readline()
            if line:
                code = json.loads(line)["code"]
            else:
                note = f"\n[the warm interpreter ended during the run; its log: {server.log}]"
        except (TimeoutError, socket.timeout):
            if pid is not None:
                kill(
                    pid
                )  # the server also stops the child's process group once this connection closes
            note = f"\n[timed out after {timeout}s]"
        stdout = out.read_text(errors="replace")
        stderr = err.read_text(errors="replace")
    return subprocess.CompletedProcess(argv, code, stdout, stderr + note)


def served() -> int:
    """Runs the warm interpreters of this process served so far (each torchrun rank counts)."""
    with _servers_lock:
        return _counts["served_by_closed"] + sum(s.served for s in _servers.values())


def summary() -> str:
    """How many runs were served warm, for the session's end."""
    count = served()
    return (
        f"warm starts: {count} runs served by {_counts['started']} warm interpreters"
        if count
        else ""
    )


@atexit.register
def close_all() -> None:
    """Stop every warm interpreter and remove its folder (at exit, and at a session's end)."""
    with _servers_lock:
        _close_idle_beyond(0)
