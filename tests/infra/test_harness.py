"""The child runner never blocks the suite: a hung run whose descendant left the process group
(a rank that outlived torchrun) is stopped whole and reported as a timeout; a distributed run's
rendezvous port is one no outgoing connection can take meanwhile."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time

import pytest
from testkit import harness
from testkit.harness import child_env, run

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="needs /proc")

# The child starts a grandchild in a new session that inherits stdout and sleeps, then sleeps
# itself: killing the child's group alone leaves the grandchild holding the pipe.
_ESCAPES = textwrap.dedent("""
    import subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; print('grandchild up', flush=True); time.sleep(600)"],
                                  start_new_session=True)
    print("GRANDCHILD", grandchild.pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_a_hung_run_with_an_escaped_descendant_ends_at_its_timeout(tmp_path):
    start = time.monotonic()
    proc = run([sys.executable, "-c", _ESCAPES], tmp_path, child_env(), timeout=5)
    took = time.monotonic() - start
    assert proc.returncode is None and "[timed out after 5s]" in proc.stderr, proc
    pids = [
        int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("GRANDCHILD")
    ]
    assert pids, proc.stdout
    assert took < 30, took
    time.sleep(0.2)
    assert not _alive(pids[0]), "the escaped grandchild still runs"


def test_a_rendezvous_port_lies_below_the_ephemeral_range_and_is_free():
    low = harness._ephemeral_low()
    ports = {harness.free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), (ports, low)
    assert len(ports) > 1, "every run would draw the same port"
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_rendezvous_port_skips_one_that_is_taken(monkeypatch):
    low = harness._ephemeral_low()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", low - 1))
        taken.listen()
        monkeypatch.setattr(harness, "PORTS_BELOW", 2)  # draws low-2 and low-1 only
        assert {harness.free_port() for _ in range(10)} == {low - 2}
