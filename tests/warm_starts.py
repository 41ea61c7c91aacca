"""Warm starts: a user script run in a fork of an interpreter of this venv that has already imported
the frameworks (tests/warm/server.py), instead of in a fresh interpreter that imports them again.

Importing torch, transformers and peft costs a script about 5 s of CPU, most of what a tiny run
costs; the integration suite runs hundreds of them. A child of the warm interpreter starts from the
state a fresh `python script.py` with the same environment reaches after those imports, gcpatch
included: the start-up file ran and gcpatch armed its patch points at the import of torch in the
warm interpreter, as it would in the script; the plugins load, and the settings that only a decision
reads are read, in the child at the first checkpointing call.

One warm interpreter serves every run whose environment agrees with it in all but `PER_RUN` (read
after the first call, never at import). Runs it cannot serve as faithfully start fresh: a launcher
(`-m torch.distributed.run`), interpreter flags, a run without GCPATCH in its environment (a script
that activates gcpatch itself by `import gcpatch`, where the import order is the subject). Set
GCPATCH_TEST_WARM=0 to start every run fresh (the matrix command does, and any suspicion should).
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

SERVER = Path(__file__).resolve().parent / "warm" / "server.py"
# Variables whose value nothing uses before the script's own first call: gcpatch's record folder, verify,
# memory budget and local plugins (used from the first checkpointing call on: engine._load, pipeline,
# verify, planner; at import gcpatch uses only GCPATCH, GCPATCH_MODE and GCPATCH_DISABLE_PLUGINS,
# engine.arm), the rendezvous port (init_process_group) and the run's kill token. Runs that differ only
# in these share a warm interpreter, whose environment lacks them.
PER_RUN = frozenset({"GCPATCH_RECORD", "GCPATCH_VERIFY", "GCPATCH_MEMORY_BUDGET", "GCPATCH_LOCAL_PLUGINS",
                     "GCPATCH_TEST_RUN", "MASTER_PORT"})


def enabled() -> bool:
    return os.environ.get("GCPATCH_TEST_WARM", "1").strip().lower() not in ("0", "false", "no", "off")


def servable(argv: list[str], env: dict[str, str]) -> bool:
    """`python script.py ...` of this venv with GCPATCH set either way."""
    return (len(argv) >= 2 and argv[0] == sys.executable and argv[1].endswith(".py")
            and not argv[1].startswith("-") and "GCPATCH" in env)


class WarmInterpreter:
    """One server process and the thread that reads its answers."""

    def __init__(self, env: dict[str, str]) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="gcpatch-warm-"))
        self.log = self.home / "server.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(SERVER)], cwd=self.home, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self._send = threading.Lock()
        self._pids: queue.Queue = queue.Queue()
        self._exits: dict[int, int] = {}
        self._ended = threading.Condition()
        self._closed = False
        self.served = 0
        threading.Thread(target=self._read, name="gcpatch-warm-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            if "pid" in message:
                self._pids.put(message["pid"])
            elif "exit" in message:
                with self._ended:
                    self._exits[message["exit"]] = message["code"]
                    self._ended.notify_all()
        with self._ended:  # the server is gone: no exit will be reported any more
            self._closed = True
            self._ended.notify_all()
        self._pids.put(None)

    def start(self, request: dict) -> int | None:
        """Fork a child for the request; its pid, or None when the server is gone."""
        with self._send:
            if self.proc.poll() is not None:
                return None
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            except OSError:
                return None
            pid = self._pids.get()
        if pid is not None:
            self.served += 1
        return pid

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code; None when it still runs after `timeout`, or when the server ended
        first (then nobody can learn it: `lost` says so)."""
        with self._ended:
            self._ended.wait_for(lambda: pid in self._exits or self._closed, timeout)
            return self._exits.pop(pid, None)

    @property
    def lost(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.home, ignore_errors=True)


_servers: dict[tuple, WarmInterpreter] = {}
_servers_lock = threading.Lock()


def _server_for(env: dict[str, str]) -> WarmInterpreter:
    start_env = {k: v for k, v in env.items() if k not in PER_RUN}
    key = tuple(sorted(start_env.items()))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server.proc.poll() is not None:
            if server is not None:
                sys.stderr.write(f"warm start: the warm interpreter ended ({server.proc.returncode}); "
                                 f"its log: {server.log}\n")
            server = _servers[key] = WarmInterpreter(start_env)
        return server


def run(argv: list[str], cwd: Path | str, env: dict[str, str], timeout: float,
        kill: Callable[[int], None]) -> subprocess.CompletedProcess | None:
    """Run `python script.py ...` in a fork of a warm interpreter; None when no warm interpreter
    could take it (the caller starts it fresh). On a timeout `kill(pid)` stops the child and what
    it started, and the returncode is None, as for a fresh run."""
    server = _server_for(env)
    with tempfile.TemporaryDirectory(prefix="gcpatch-warm-run-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        pid = server.start({"argv": argv, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)})
        if pid is None:
            sys.stderr.write(f"warm start: no warm interpreter for {argv[1]}, started fresh; log: {server.log}\n")
            return None
        code = server.wait(pid, timeout)
        timed_out = code is None and not server.lost
        if server.lost and code is None:
            kill(pid)
            sys.stderr.write(f"warm start: the warm interpreter ended during {argv[1]}; log: {server.log}\n")
        if timed_out:
            kill(pid)
            code = server.wait(pid, 30)
        stdout = out.read_text(errors="replace") if out.exists() else ""
        stderr = err.read_text(errors="replace") if err.exists() else ""
    if timed_out:
        return subprocess.CompletedProcess(argv, None, stdout, stderr + f"\n[timed out after {timeout}s]")  # type: ignore[arg-type]
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


def summary() -> str:
    """How many runs the warm interpreters served, for the session's end."""
    served = sum(s.served for s in _servers.values())
    return f"warm starts: {served} runs served by {len(_servers)} warm interpreters" if _servers else ""


@atexit.register
def _close_all() -> None:
    for server in list(_servers.values()):
        server.close()
    _servers.clear()
