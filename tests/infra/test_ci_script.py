"""The test command: the README's is `.ci/run`'s (one script), a Python it cannot find is skipped
with a line, and an env whose pytest selects nothing says so and passes (exit code 5)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_test_command_is_ci_run():
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start") :].split("```")[1]
    commands = [
        line for line in quick_start.splitlines()[1:] if line.strip() and not line.startswith("#")
    ]
    assert len(commands) == 2 and commands[1] == "bash .ci/run"
    assert "bash .ci/run" in (ROOT / "CONTRIBUTING.md").read_text()


def test_a_python_that_is_not_found_is_skipped_with_a_line(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3.11").symlink_to(sys.executable)
    path = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"
    if shutil.which("python3.9", path=path):
        pytest.skip("python3.9 is on the system path here")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCPATCH_PY")}
    env.update(PATH=path, PYENV_ROOT=str(tmp_path / "no-pyenv"))
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci" / "run"), "-e", "py39"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "skipped py39: no python3.9 found (set GCPATCH_PY39 to one to run it)",
        ".ci/run: no env to run",
    ]


@pytest.mark.parametrize(
    "body, code, said",
    [
        ("def test_a():\n    pass\n", 0, False),
        ("def test_a():\n    assert False\n", 1, False),
    ],
)
def test_pytest_exit_codes_pass_through_but_no_test_collected_passes_with_a_line(
    tmp_path, body, code, said
):
    (tmp_path / "test_x.py").write_text(body)
    proc = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "run_pytest.py"), str(tmp_path / "test_x.py")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == code and ("collected no test" in proc.stdout) is said


def test_no_test_collected_passes_with_a_line(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_a():\n    pass\n")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / ".ci" / "run_pytest.py"),
            str(tmp_path / "test_x.py"),
            "-k",
            "nothing_matches",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout
    assert re.search(r"pytest collected no test from: .*test_x.py -k nothing_matches", proc.stdout)
