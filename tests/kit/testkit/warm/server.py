"""A warm interpreter: it imports the frameworks once, then forks one child per script it is asked
to run, and the child runs that script as `python script.py` would, from the state a fresh
interpreter reaches after the same imports. Started by tests/kit/testkit/warm_starts.py, alone in its folder
(with the rank launcher) so that its sys.path[0] holds no module a script could import by mistake.

Protocol: the server listens on the unix socket named by its first argument. A client connects and
sends one JSON request {"argv", "cwd", "env", "unbuffered"} with its stdin, stdout and stderr as
passed descriptors; the server answers {"pid": N} when the child starts and {"code": C} when it
ends (C as subprocess gives it: negative for a signal). A client that goes away first takes its
child with it (SIGKILL to the child's process group). EOF on the server's stdin (its owner ended)
stops the server and every child still running.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import os
import select
import signal
import socket
import sys
import threading
import types

# What the scripts import first, and most of their cost (about 5 s of CPU together); a module that is
# not installed is left out. GCPATCH_TEST_WARM_PRELOAD (comma-separated) names others instead.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.trainer",
    "peft",
    "datasets",
    "accelerate",
    "deepspeed",
    "colossalai.booster",
)
MAX_REQUEST = 1 << 20


def _preload() -> None:
    chosen = os.environ.get("GCPATCH_TEST_WARM_PRELOAD")
    for name in chosen.split(",") if chosen else PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        except Exception as exc:  # noqa: BLE001 - the script meets it again at its own import, and says so
            sys.stderr.write(f"warm server: not preloaded: {name} ({type(exc).__name__}: {exc})\n")


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:  # the client went away; its child is stopped when the server sees the EOF
        pass


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def serve(path: str) -> tuple[dict, list[int]] | None:
    """The server loop; returns in a forked child with that child's request and descriptors, None
    when the owner is gone."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    _preload()
    gc.collect()
    gc.freeze()  # the children's collections leave the preloaded objects (and their pages) alone
    sys.stdout.flush()
    sys.stderr.flush()
    clients: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    while True:
        ready, _, _ = select.select([0, listener, *clients.values()], [], [], 0.05)
        _reap(clients)
        for source in ready:
            if source == 0:
                if not os.read(0, 1024):
                    for pid in clients:
                        _kill(pid)
                    return None
            elif source is listener:
                child = _fork_for(listener, clients)
                if child is not None:
                    return child
            else:  # a client's connection: anything but EOF is not expected; EOF means it is gone
                pid = next(p for p, c in clients.items() if c is source)
                if not source.recv(1024):
                    _kill(pid)
                    del clients[pid]
                    source.close()


def _reap(clients: dict[int, socket.socket]) -> None:
    """Reap every child that ended, and tell its client its exit code."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is not None:
            _send(conn, {"code": os.waitstatus_to_exitcode(status)})
            conn.close()


def _fork_for(
    listener: socket.socket, clients: dict[int, socket.socket]
) -> tuple[dict, list[int]] | None:
    """Accept one request and fork a child for it: in the child, its request and descriptors; in
    the server, None (the child's pid told to the client and counted by the owner)."""
    conn, _ = listener.accept()
    data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        for other in clients.values():
            other.close()
        return json.loads(data), fds
    for fd in fds:
        os.close(fd)
    clients[pid] = conn
    _send(conn, {"pid": pid})
    os.write(1, f"served {pid}\n".encode())  # the owner counts these
    return None


def _become(request: dict, fds: list[int]) -> None:
    """The process state `python script.py` starts the script in: own session, the client's stdin,
    stdout and stderr, its cwd, environment, argv and sys.path[0], and a fresh `__main__`."""
    os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    for fd in (0, 1, 2):
        os.set_inheritable(fd, True)
    if request.get("unbuffered"):  # python -u, as torchrun starts its ranks
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
        )
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's stdin, as the interpreter opens it
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][1]
    sys.argv = request["argv"][1:]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__cached__ = None
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main


def run_child(request: dict, fds: list[int]) -> int:
    """Run the script as the interpreter's main program does: its exit status from SystemExit, an
    uncaught exception through sys.excepthook (as gcpatch's crash notes expect) and status 1."""
    _become(request, fds)
    script = sys.argv[0]
    main = sys.modules["__main__"]
    try:
        with open(script, "rb") as f:
            code = compile(f.read(), script, "exec")
        exec(code, main.__dict__)  # noqa: S102 - running the script is the point
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - the interpreter's own: report through the hook, exit 1
        kind, value, tb = sys.exc_info()
        sys.excepthook(kind, value, tb.tb_next if tb is not None else tb)
        return 1
    return 0


def leave(code: int) -> None:
    """End the child as the interpreter ends a program (non-daemon threads joined, atexit functions
    run, the script's own objects finalized, output flushed) but without tearing down the modules
    it inherited: that teardown writes to every preloaded object and so copies every page the child
    shares with the server, seconds for a run that took milliseconds."""
    threading._shutdown()  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    main = sys.modules.get("__main__")
    if main is not None:
        main.__dict__.clear()
    gc.collect()  # only what the child made: the server froze its own objects before forking
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the script, as at a normal exit: nothing to flush
            pass
    os._exit(code)


if __name__ == "__main__":
    asked = serve(sys.argv[1])
    if asked is None:
        sys.exit(0)
    leave(run_child(*asked))
