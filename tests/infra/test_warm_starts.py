"""A warm start runs a script as a fresh `python script.py` would: same argv, cwd, environment,
sys.path[0], `__main__`, output, exit status (SystemExit, an uncaught exception through
sys.excepthook), and a timeout that stops the script and what it started. What differs is only
that the frameworks are already imported, which the script sees in sys.modules. A small module stands
in for the frameworks here (GCPATCH_TEST_WARM_PRELOAD), so that this runs anywhere and quickly."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest
from testkit import harness, warm_starts

SCRIPT = """\
import json, os, sys
print("RESULT " + json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__, "file": __file__,
    "env": os.environ.get("WARM_PROBE"), "record": os.environ.get("GCPATCH_RECORD"),
    "preloaded": PRELOADED, "stdin": sys.stdin.read(),
}))
print("to stderr", file=sys.stderr)
import atexit, threading, time
atexit.register(lambda: print("ATEXIT", file=sys.stderr))
threading.Thread(target=lambda: (time.sleep(0.3), print("THREAD JOINED", file=sys.stderr))).start()
left_open = open(os.path.join(os.getcwd(), "left_open.txt"), "w")
left_open.write("flushed at exit")  # never closed: the interpreter's finalization flushes it
exit_how = sys.argv[1] if len(sys.argv) > 1 else ""
if exit_how == "code":
    sys.exit(3)
if exit_how == "message":
    sys.exit("a message")
if exit_how == "raise":
    sys.excepthook = lambda kind, value, tb: print("HOOK", kind.__name__, value, file=sys.stderr)
    raise ValueError("boom")
"""


def run(tmp_path, *args, warm=True, **env):
    """The probe script (written once under tmp_path/scripts), run from tmp_path/work."""
    path, work = tmp_path / "scripts" / "probe.py", tmp_path / "work"
    if not path.exists():
        path.parent.mkdir()
        work.mkdir()
        path.write_text('import sys\nPRELOADED = "wave" in sys.modules\n' + SCRIPT)
    env = harness.child_env(GCPATCH="0", GCPATCH_TEST_WARM_PRELOAD="wave", **env)
    return harness.run([sys.executable, str(path), *args], work, env, 120, warm=warm)


@pytest.fixture
def served():
    before = warm_starts.served()
    yield lambda: warm_starts.served() - before


def test_warm_run_sees_what_a_fresh_run_sees(tmp_path, served):
    fresh = run(tmp_path, "a", warm=False, WARM_PROBE="x", GCPATCH_RECORD=str(tmp_path / "r1"))
    warm = run(tmp_path, "a", WARM_PROBE="x", GCPATCH_RECORD=str(tmp_path / "r2"))
    assert served() == 1
    f, w = harness.result_of(fresh), harness.result_of(warm)
    assert fresh.returncode == warm.returncode == 0
    for key in ("argv", "cwd", "path0", "name", "file", "env", "stdin"):
        assert f[key] == w[key], key
    assert f["name"] == "__main__" and f["path0"] == str(tmp_path / "scripts") and f["stdin"] == ""
    assert w["record"] == str(tmp_path / "r2")  # a variable of the run, not of the warm interpreter
    assert "to stderr" in warm.stderr and "to stderr" not in warm.stdout
    assert (f["preloaded"], w["preloaded"]) == (False, True)  # the imports it saves
    for proc in (
        fresh,
        warm,
    ):  # a program's end: threads joined, atexit run, its open files flushed
        assert "THREAD JOINED" in proc.stderr and proc.stderr.index(
            "THREAD JOINED"
        ) < proc.stderr.index("ATEXIT")
    assert (tmp_path / "work" / "left_open.txt").read_text() == "flushed at exit"


@pytest.mark.parametrize(
    "how, code, stderr",
    [("code", 3, "to stderr"), ("message", 1, "a message"), ("raise", 1, "HOOK ValueError boom")],
)
def test_exit_status_as_the_interpreter_gives_it(tmp_path, served, how, code, stderr):
    fresh, warm = run(tmp_path, how, warm=False), run(tmp_path, how)
    assert served() == 1
    assert fresh.returncode == warm.returncode == code
    assert stderr in fresh.stderr and stderr in warm.stderr


def test_environment_that_changes_imports_gets_its_own_warm_interpreter(tmp_path, served):
    run(tmp_path, WARM_PROBE="1")
    started = warm_starts._counts["started"]
    run(tmp_path, WARM_PROBE="1", GCPATCH_RECORD="elsewhere")  # per run: the same interpreter
    assert warm_starts._counts["started"] == started
    run(tmp_path, WARM_PROBE="2")  # read at import as far as anyone knows: another one
    assert warm_starts._counts["started"] == started + 1
    assert served() == 3


def test_idle_warm_interpreters_beyond_the_cap_are_closed_and_their_runs_still_counted(
    tmp_path, monkeypatch
):
    """Each holds hundreds of MB: the longest idle goes first; what it served still counts."""
    monkeypatch.setattr(warm_starts, "MAX_LIVE", 2)
    before = warm_starts.served()
    for probe in ("a", "b", "c", "a"):
        assert run(tmp_path, WARM_PROBE=probe).returncode == 0
        assert len(warm_starts._servers) <= 2
    assert warm_starts.served() == before + 4


def test_timeout_stops_the_script_and_what_it_started(tmp_path):
    path = tmp_path / "hang.py"
    pidfile = tmp_path / "grandchild.pid"
    path.write_text(
        textwrap.dedent(f"""\
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        open({str(pidfile)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(600)
    """)
    )
    start = time.monotonic()
    env = harness.child_env(GCPATCH="0", GCPATCH_TEST_WARM_PRELOAD="wave")
    proc = harness.run([sys.executable, str(path)], tmp_path, env, 5, warm=True)
    assert (
        proc.returncode is None and "timed out after 5" in proc.stderr and "started" in proc.stdout
    )
    assert time.monotonic() - start < 40
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while (
        time.monotonic() < deadline
        and harness.Path(f"/proc/{grandchild}").exists()
        and "Z" not in harness.Path(f"/proc/{grandchild}/stat").read_text().split()[2]
    ):
        time.sleep(0.2)
    stat = harness.Path(f"/proc/{grandchild}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z", (
        "the grandchild outlived the timeout"
    )


def test_runs_it_cannot_serve_faithfully_start_fresh(tmp_path):
    probe = str(tmp_path / "p.py")
    assert warm_starts.servable([sys.executable, probe], {"GCPATCH": "1"})
    assert not warm_starts.servable(
        [sys.executable, probe], {}
    )  # `import gcpatch` decides, in order
    assert not warm_starts.servable([sys.executable, "-X", "importtime", probe], {"GCPATCH": "1"})
    assert not warm_starts.servable([sys.executable, "-m", "pdb", probe], {"GCPATCH": "1"})
    assert warm_starts.servable(harness.torchrun_argv(2, probe), {"GCPATCH": "1"})


RANK_SCRIPT = """\
import json, os, sys, time
print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), "world": os.environ["WORLD_SIZE"],
      "local": os.environ["LOCAL_RANK"], "run_id": "TORCHELASTIC_RUN_ID" in os.environ, "argv": sys.argv[1:],
      "preloaded": PRELOADED, "env": sorted(os.environ)}), flush=True)
# torchrun stops the other ranks when one fails: rank 1 fails only once rank 0's line is out
printed = os.path.join(HERE, "rank0-printed-" + os.environ["MASTER_PORT"])
if os.environ["RANK"] == "0":
    open(printed, "w").close()
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(printed) and time.monotonic() < deadline:
        time.sleep(0.05)
if sys.argv[1] == "fail" and os.environ["RANK"] == "1":
    sys.exit(3)
if sys.argv[1] == "abort" and os.environ["RANK"] == "1":
    os.abort()
"""


@pytest.mark.parametrize("how", ["ok", "fail", "abort"])
def test_torchrun_ranks_start_warm_with_the_environment_torchrun_gives(tmp_path, served, how):
    pytest.importorskip("torch.distributed.run")
    path = tmp_path / "ranks.py"
    path.write_text(
        f'import sys\nPRELOADED = "wave" in sys.modules\nHERE = {str(tmp_path)!r}\n' + RANK_SCRIPT
    )
    env = harness.child_env(GCPATCH="0", GCPATCH_TEST_WARM_PRELOAD="wave")
    fresh, warm = (
        harness.run(harness.torchrun_argv(2, str(path), how), tmp_path, env, 120, warm=w)
        for w in (False, True)
    )
    assert served() == 2
    for proc, preloaded in ((fresh, False), (warm, True)):
        results = sorted(harness.parse_results(proc.stdout), key=lambda r: r["rank"])
        assert [r["rank"] for r in results] == [0, 1], proc.stderr
        assert all(
            r["preloaded"] is preloaded and r["world"] == "2" and r["run_id"] and r["argv"] == [how]
            for r in results
        )
    # the same variables as a rank torchrun started itself: nothing of the warm start leaks into them
    envs = [
        [r["env"] for r in sorted(harness.parse_results(proc.stdout), key=lambda r: r["rank"])]
        for proc in (fresh, warm)
    ]
    assert envs[0] and envs[0] == envs[1]
    assert (fresh.returncode == 0) is (warm.returncode == 0) is (how == "ok")
    if how != "ok":  # torchrun names the failed rank and its exit code, -6 for SIGABRT
        code = "3" if how == "fail" else "-6"
        for proc in (fresh, warm):
            assert f"exitcode  : {code}" in proc.stderr and "rank      : 1" in proc.stderr, (
                proc.stderr[-3000:]
            )
