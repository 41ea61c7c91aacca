"""gcpatch inside another tool: a user's pytest suite run with `-W error` passes under GCPATCH=1
as it does plainly (pytest no longer warns that the start-up module, imported by the .pth line,
cannot be rewritten), and an exception the test expects and catches carries gcpatch's note but
leaves no ERROR line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _run import child_env

SUITE = Path(__file__).resolve().parent / "user_suite" / "strict_warnings.py"


@pytest.fixture(scope="module", params=["0", "1"], ids=["plain", "GCPATCH=1"])
def session(request, tmp_path_factory) -> tuple[str, subprocess.CompletedProcess]:
    cwd = tmp_path_factory.mktemp(
        "strict-suite"
    )  # outside the checkout: the installed gcpatch runs
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-W",
            "error",
            "-p",
            "no:cacheprovider",
            str(SUITE),
        ],
        cwd=cwd,
        env=child_env(GCPATCH=request.param),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return request.param, proc


def test_a_warnings_as_errors_suite_passes(session):
    _, proc = session
    assert proc.returncode == 0 and "2 passed" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    assert "PytestAssertRewriteWarning" not in proc.stdout + proc.stderr


def test_a_caught_error_gets_the_note_and_no_error_line(session):
    gcpatch, proc = session
    out = proc.stdout + proc.stderr
    expected = "USER-NOTES 1 gcpatch [backward_twice]" if gcpatch == "1" else "USER-NOTES 0"
    assert expected in out, out[-3000:]
    assert "crash explained" not in out and "ERROR" not in out, out[-3000:]
