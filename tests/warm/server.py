"""A warm interpreter: it imports the frameworks once, then forks one child per script it is sent,
and the child runs that script as `python script.py` would, from the state a fresh interpreter
reaches after the same imports. Started by tests/warm_starts.py, alone in its folder so that its
sys.path[0] holds no other module.

Protocol (one JSON object a line): stdin gets {"argv", "cwd", "env", "out", "err"}; stdout answers
{"ready": [modules]} once, then {"pid": N} for each request in order, and {"exit": N, "code": C}
when a child ends (C as subprocess gives it: negative for a signal). EOF on stdin ends the server.
"""
from __future__ import annotations

import importlib
import json
import os
import select
import sys
import types

# What the scripts import first, and most of their cost (about 5 s of CPU together); a module that is
# not installed is left out. GCPATCH_TEST_WARM_PRELOAD (comma-separated) names others instead.
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.trainer", "peft",
           "datasets", "accelerate", "deepspeed")


def _say(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _preload() -> list[str]:
    loaded = []
    chosen = os.environ.get("GCPATCH_TEST_WARM_PRELOAD")
    for name in chosen.split(",") if chosen else PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        loaded.append(name)
    return loaded


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve() -> dict | None:
    """The server loop; returns in a forked child with that child's request, None at EOF."""
    _say({"ready": _preload()})
    sys.stdout.flush()
    sys.stderr.flush()
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        _reap()
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                return request
            _say({"pid": pid})


def _become(request: dict) -> None:
    """The process state `python script.py` starts the script in: own session, its output files,
    no stdin, its cwd, environment, argv and sys.path[0], and a fresh `__main__`."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    sys.stdin = open(0, closefd=False)
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


def run_child(request: dict) -> int:
    """Run the script as the interpreter's main program does: its exit status from SystemExit, an
    uncaught exception through sys.excepthook (as gcpatch's crash notes expect) and status 1."""
    _become(request)
    script = sys.argv[0]
    main = sys.modules["__main__"]
    try:
        with open(script, "rb") as f:
            code = compile(f.read(), script, "exec")
        exec(code, main.__dict__)
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


if __name__ == "__main__":
    child_request = serve()
    if child_request is None:
        sys.exit(0)
    sys.exit(run_child(child_request))
