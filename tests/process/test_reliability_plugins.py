"""Fault injection into every hookspec of a third-party plugin (raise, garbage, wrong type) in fix
and strict mode, through the real entry-point group (tests/kit/testkit/faults/plugin.py).

Fix mode: the job trains, the plugin is dropped or disabled with exactly one line naming it, and
the built-in rules still decide (R1 keeps the gradients right). Strict mode: a GcpatchError naming
the plugin. A failing patch-point wrapper logs once, not on every call.
"""

from __future__ import annotations

import json

import pytest
from testkit.faultkit import FAULTS, install_fault_plugin, run, tally
from testkit.subproc import requires_transformers

pytestmark = requires_transformers


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return install_fault_plugin(tmp_path_factory.mktemp("faulty") / "site")


def _matrix(site, tmp_path, mode):
    proc = run(
        f"import runpy; runpy.run_path({str(FAULTS / 'hook_matrix.py')!r}, run_name='__main__')",
        tmp_path,
        GCPATCH="1",
        GCPATCH_MODE=mode,
        PYTHONPATH=site,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    cases = [
        json.loads(line[len("RESULT ") :])
        for line in proc.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    assert len(cases) == 11, proc.stdout[-2000:]
    return cases


def test_fix_mode_a_faulty_plugin_costs_nothing_but_one_line(site, tmp_path):
    problems = []
    for case in _matrix(site, tmp_path, "fix"):
        name = f"{case['hook'] or 'control'}/{case['kind'] or '-'}"
        survived = case["error"] is None and case["work"] == [1, 2, 3, 4]
        lost = case["wrong_grads"] != 0  # the built-in R1 must still decide: 0 wrong gradients
        expected_lines = 0 if not case["hook"] else 1
        clear = len(case["faulty_lines"]) == expected_lines and all(
            "faulty" in line and ("disabled" in line or "dropped" in line or "unpatched" in line)
            for line in case["faulty_lines"]
        )
        if case["hook"] == "vote":
            clear = clear and "built-in ones included, still decide" in case["faulty_lines"][0]
        tally("plugin faults (fix)", name, survived, clear, lost)
        if not (survived and clear and not lost):
            problems.append((name, case))
    assert problems == []


def test_strict_mode_raises_one_error_naming_the_plugin(site, tmp_path):
    problems = []
    for case in _matrix(site, tmp_path, "strict"):
        name = f"{case['hook'] or 'control'}/{case['kind'] or '-'}"
        if not case["hook"]:
            ok = case["error"] is None and case["wrong_grads"] == 0
            tally("plugin faults (strict)", name, ok, ok, case["wrong_grads"] != 0)
        else:
            error = case["error"] or ""
            ok = (
                error.startswith("GcpatchError: [plugin:faulty]")
                and "injected fault" in error
                or (error.startswith("GcpatchError: [plugin:faulty]") and case["kind"] != "raise")
            )
            tally("plugin faults (strict)", name, not error.startswith("CRASH"), ok, False)
        if not ok:
            problems.append((name, case))
    assert problems == []
