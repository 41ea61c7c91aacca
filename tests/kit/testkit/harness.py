"""The one way every suite, benchmark and matrix cell runs user code: an interpreter of this venv,
fresh or, where the caller allows it, warm (tests/kit/testkit/warm_starts.py) (so the INSTALLED gcpatch runs,
as a user meets it), an environment that carries none
of the caller's GCPATCH* variables and never reaches a hub, and one result protocol: the child
prints `RESULT {json}`, one per process."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

from testkit import warm_starts

RESULT = "RESULT "


def child_env(quiet: bool = False, **extra: str) -> dict[str, str]:
    """The caller's environment without GCPATCH* or PYTHONPATH (name them in `extra`), offline;
    `quiet` also mutes Python's and transformers' warnings for tests that do not look at them.
    Threads are the caller's (torch's default where it sets none): a test's result may not depend
    on them; a benchmark that times pins its own. An idle OpenMP thread sleeps where the caller
    says nothing else (OMP_WAIT_POLICY=PASSIVE, as tox.ini sets it): the suites run processes side
    by side, whose spinning threads otherwise stall each other on shared cores (docs/CI.md)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCPATCH") and k != "PYTHONPATH"}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if quiet:
        env.update(TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORTS_BELOW = 12000  # how far below the kernel's ephemeral range ports are drawn


def _ephemeral_low() -> int:
    """Where the kernel's range of ports for outgoing connections starts (Linux's default where
    it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port nobody listens on now (one per distributed run, so parallel runs never meet),
    drawn below the kernel's ephemeral range: the port is free again until the run binds it, and
    one from that range may meanwhile become the local end of any outgoing connection (another
    run's gloo ranks), which fails the rendezvous with EADDRINUSE; below it only a bind can."""
    low = _ephemeral_low()
    ports = range(max(1024, low - PORTS_BELOW), low)
    # the system's randomness: a test seeding `random` would give parallel suites one sequence
    for port in random.SystemRandom().sample(ports, min(64, len(ports))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken: draw another
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_argv(nproc: int, *script: str) -> list[str]:
    """`python -m torch.distributed.run` (not bin/torchrun: copied venvs keep the old shebang),
    gloo ranks on the local host."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *script,
    ]


def parse_results(stdout: str) -> list[Any]:
    """Every `RESULT <json>` in stdout. Ranks share one pipe, so a line may hold two of them:
    each is decoded from where its marker starts, not line by line."""
    decoder = json.JSONDecoder()
    results, pos = [], stdout.find(RESULT)
    while pos != -1:
        try:
            value, end = decoder.raw_decode(stdout, pos + len(RESULT))
        except ValueError:  # the word in other text, not a result
            end = pos + len(RESULT)
        else:
            results.append(value)
        pos = stdout.find(RESULT, end)
    return results


def result_of(proc: subprocess.CompletedProcess) -> Any:
    """The RESULT a single-process run printed (its first, where a script prints more)."""
    results = parse_results(proc.stdout or "")
    if not results:
        raise AssertionError(f"no RESULT line\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return results[0]


RUN_MARK = "GCPATCH_TEST_RUN"  # in every process a run starts, so a timeout finds them all


def _processes_marked(token: str) -> list[int]:
    """Pids whose environment carries this run's token: the child and every descendant, also one
    that left the child's process group or session (a rank that outlived its launcher)."""
    needle = f"{RUN_MARK}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def _kill_run(pid: int, token: str) -> None:
    """SIGKILL the child's process group and every process that carries the run's token."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if Path("/proc/self/environ").exists():
        for marked in _processes_marked(token):
            try:
                os.kill(marked, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run(
    argv: list[str], cwd: Path | str, env: dict[str, str], timeout: float = 300, warm: bool = False
) -> subprocess.CompletedProcess:
    """Run a child; a hang shows as returncode None with what it printed before, instead of
    blocking the suite. The child leads its own process group and every process it starts
    inherits a token in its environment, so a hang's descendants (the ranks under torchrun, even
    one that left the group) are stopped with it: none keeps the output pipes open.

    `warm`: a script may start as a fork of a warm interpreter (tests/kit/testkit/warm_starts.py), also each
    rank under torchrun."""
    token = uuid.uuid4().hex
    if warm and warm_starts.enabled() and warm_starts.servable(argv, env):
        if warm_starts.under_torchrun(argv):
            with warm_starts.torchrun_launch(argv, env) as launch:
                return _run_fresh(launch, cwd, env, timeout, token)
        done = warm_starts.run(
            argv, cwd, env, timeout, lambda pid: _kill_run(pid, token), {RUN_MARK: token}
        )
        if done is not None:
            return done
    return _run_fresh(argv, cwd, env, timeout, token)


def _run_fresh(
    argv: list[str], cwd: Path | str, env: dict[str, str], timeout: float, token: str
) -> subprocess.CompletedProcess:
    with subprocess.Popen(
        argv,
        cwd=cwd,
        env={**env, RUN_MARK: token},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_run(proc.pid, token)
            try:
                out, err = proc.communicate(timeout=30)
            except (
                subprocess.TimeoutExpired
            ):  # a writer out of reach (no /proc): give up on its output
                out, err = (
                    "",
                    "[output lost: a process of the run kept the pipes open after the kill]",
                )
                for pipe in (proc.stdout, proc.stderr):
                    pipe.close()
            return subprocess.CompletedProcess(
                argv, None, out or "", (err or "") + f"\n[timed out after {timeout}s]"
            )  # type: ignore[arg-type]
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_python(
    code: str, cwd: Path | str, args: list[str] | None = None, timeout: float = 300, **env: str
) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter of this venv, cwd `cwd` (never the checkout)."""
    return run(
        [sys.executable, *(args or []), "-c", textwrap.dedent(code)],
        cwd,
        child_env(quiet=True, **env),
        timeout,
    )


def messages(stderr: str) -> list[str]:
    """stderr's lines with each gcpatch message whole: gcpatch wraps a long message at words
    into continuation lines indented by four spaces (gcpatch/headline.py `wrap`), joined here."""
    out: list[str] = []
    for line in stderr.splitlines():
        if line.startswith("    ") and out and out[-1].startswith("gcpatch"):
            out[-1] += " " + line[4:]
        else:
            out.append(line)
    return out
