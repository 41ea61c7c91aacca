"""The suite's runner accepts a non-zero exit from a distributed run only for gloo's teardown abort
after every rank reported (integration/_run.py: TEARDOWN_ABORT, pytorch/pytorch#179291); any
other failure still fails the test that reads the run. The stderr below is torchrun's, as CI saw it.
A run whose rendezvous port another process bound meanwhile never started: it runs again."""

import socket
from pathlib import Path

from _run import TEARDOWN_ABORT, Run, Spec, run_script

RESULTS = [{"rank": 0, "wrong": 0}, {"rank": 1, "wrong": 0}]
ABORT = (
    f"{TEARDOWN_ABORT}\n"
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    "  rank      : 0 (local_rank: 0)\n  exitcode  : -6 (pid: 790)  (SIGABRT)\n"
)
CRASH = (
    "Traceback (most recent call last):\nRuntimeError: Expected to mark a variable ready only once.\n"
    "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 790)\n"
)


def _run(stderr: str, results: list, launcher: str = "torchrun2", returncode: int = 1) -> Run:
    return Run(
        Spec("verify_trainer.py", launcher=launcher),
        returncode,
        "",
        stderr,
        Path("."),
        1.0,
        results[0] if results else {},
        list(results),
    )


def test_the_teardown_abort_after_every_result_is_a_clean_exit():
    assert _run(ABORT, RESULTS).exited_cleanly()
    assert _run("", RESULTS, returncode=0).exited_cleanly()


def test_every_other_failure_is_not():
    assert not _run(
        ABORT, RESULTS[:1]
    ).exited_cleanly()  # a rank did not report: the abort came before
    assert not _run(CRASH, RESULTS).exited_cleanly()  # a Python error in a rank
    assert not _run(
        ABORT, RESULTS[:1], launcher="python", returncode=-6
    ).exited_cleanly()  # not distributed


def test_a_distributed_run_whose_rendezvous_port_was_taken_runs_again_on_a_new_one(
    tmp_path, monkeypatch
):
    from testkit import harness

    drawn = []

    def draw() -> int:
        drawn.append(harness_free_port() if drawn else taken.getsockname()[1])
        return drawn[-1]

    harness_free_port = harness.free_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", harness_free_port()))
        taken.listen()
        monkeypatch.setattr(harness, "free_port", draw)
        run = run_script(Spec("fsdp_nested.py", launcher="torchrun2"), tmp_path)
    assert len(drawn) == 2 and drawn[0] != drawn[1], drawn
    assert run.exited_cleanly() and len(run.results) == 2, run.describe()
