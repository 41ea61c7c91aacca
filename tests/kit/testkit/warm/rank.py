"""One torchrun rank started warm: torchrun (`--no-python`) starts this small client in the rank's
place (`rank.py SOCKET script ...`), with the rank's environment; it asks the warm interpreter
listening on SOCKET to run the script with that environment, cwd and this process's stdin, stdout and stderr, forwards
the signals torchrun sends, and ends as the rank ended (its exit status, or the same signal), so
that torchrun sees what it would have seen of a rank it started itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys


def main() -> int:
    path, script = sys.argv[1], sys.argv[2:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = {
        "argv": [sys.executable, *script],
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "unbuffered": True,
    }
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    answers = conn.makefile("rb")
    pid = json.loads(answers.readline())["pid"]

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, forward)
    line = answers.readline()
    if not line:
        sys.stderr.write("warm rank: the warm interpreter ended before the rank did\n")
        return 1
    code = json.loads(line)["code"]
    if code < 0:  # end by the same signal, as the rank did
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
