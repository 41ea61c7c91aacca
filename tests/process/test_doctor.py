"""`gcpatch doctor` tells the truth about a job started from its environment: with GCPATCH unset,
0 and 1, with the start-up hook missing (gcpatch only on PYTHONPATH, where Python runs no .pth
file), and with GCPATCH_MODE=strict alone, five different outputs; each verdict is checked against
a real job started the same way (does importing torch start gcpatch?)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from testkit.harness import child_env, run

DOCTOR = ["-m", "gcpatch", "doctor", "--no-import"]
# a user's job in miniature: whether gcpatch started in it is what the doctor predicted
JOB = ["-c", "import sys, torch; print('JOB', 'gcpatch.engine' in sys.modules)"]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """An interpreter whose site directories hold no gcpatch: a venv with this environment's
    site-packages on PYTHONPATH only (gcpatch importable, its gcpatch.pth never run)."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return str(venv / "bin" / "python")


CASES = {
    "unset": ({}, "OFF - GCPATCH is unset", False),
    "zero": ({"GCPATCH": "0"}, "OFF - GCPATCH=0 switches it off", False),
    "one": ({"GCPATCH": "1"}, "ON - GCPATCH=1 and the start-up hook", True),
    "hook_missing": ({"GCPATCH": "1"}, "OFF - GCPATCH=1, but the start-up hook is missing", False),
    "strict_alone": ({"GCPATCH_MODE": "strict"}, "OFF - GCPATCH is unset", False),
}


def _run(case: str, argv: list[str], bare_python: str, tmp_path) -> subprocess.CompletedProcess:
    env, _, _ = CASES[case]
    python = sys.executable
    extra = dict(env)
    if case == "hook_missing":
        python = bare_python
        # every folder this environment imports from (its site-packages, a shared torch's)
        extra["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p.endswith("-packages"))
    proc = run([python, *argv], tmp_path, child_env(quiet=True, **extra), 300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_five_setups_five_true_outputs(bare_python, tmp_path):
    outputs = {}
    for case, (_, verdict, job_on) in CASES.items():
        out = _run(case, DOCTOR, bare_python, tmp_path).stdout
        outputs[case] = out
        assert f"in a job started from this environment: {verdict}" in out, (case, out)
        job = _run(case, JOB, bare_python, tmp_path).stdout
        assert f"JOB {job_on}" in job, (case, job)  # the verdict is what a job does
        if job_on:
            assert "plugins:\n" in out, out
        else:
            assert "a job patches nothing while gcpatch is off" in out, out
    assert len(set(outputs.values())) == 5
    assert "start-up hook: missing (gcpatch.pth is in none of" in outputs["hook_missing"].replace(
        "\n    ", " "
    )
    assert "Install gcpatch into the environment" in outputs["hook_missing"]
    for case in ("unset", "zero", "one"):
        assert "start-up hook: /" in outputs[case] and "gcpatch.pth" in outputs[case]
    # a variable set while gcpatch is off protects nothing: said, in that case only
    said = "set while gcpatch is off, protecting nothing: GCPATCH_MODE=strict"
    assert said in outputs["strict_alone"]
    assert not any(said in out for case, out in outputs.items() if case != "strict_alone")
    for out in outputs.values():  # the verdict's lines wrap at 120 columns, at a word
        head = out.split("plugins", 1)[0].splitlines()
        assert max(len(line) for line in head) <= 120, head
