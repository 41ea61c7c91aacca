"""The suite's no-folder-left-behind guard (testkit/tempdirs.py) on a session that leaks one and on
one that does not: the leak fails the session by name, and neither leaves anything in the
machine's temporary folder."""

from __future__ import annotations

import subprocess
import sys

import pytest

CONFTEST = "from testkit.tempdirs import pytest_sessionfinish, pytest_sessionstart  # noqa\n"
LEAKS = """
import tempfile
def test_leaks():
    tempfile.mkdtemp(prefix="left-behind-")
"""
CLEAN = """
import tempfile
def test_cleans_up(tmp_path):
    with tempfile.TemporaryDirectory():
        (tmp_path / "kept-by-pytest").write_text("x")
"""


@pytest.mark.parametrize("body, leaks", [(LEAKS, True), (CLEAN, False)], ids=["leaks", "clean"])
def test_a_session_that_leaves_a_folder_fails_and_the_machine_keeps_nothing(tmp_path, body, leaks):
    suite, machine_tmp = tmp_path / "suite", tmp_path / "machine-tmp"
    suite.mkdir()
    machine_tmp.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_it.py").write_text(body)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
        cwd=suite,
        env={"PATH": "/usr/bin:/bin", "TMPDIR": str(machine_tmp), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if leaks:
        assert proc.returncode == 1, proc.stdout
        assert "FAILED no folder left behind" in proc.stdout and "left-behind-" in proc.stdout
    else:
        assert proc.returncode == 0, proc.stdout
        assert "no folder left behind" not in proc.stdout
    assert list(machine_tmp.iterdir()) == []
