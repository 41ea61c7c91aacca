"""The suite's kinds, one folder each: unit/ (in-process), process/ (starts interpreters), infra/ (the
test infrastructure's own tests) and docs/ (documents and the matrix agree with the code). Each test
is marked with its folder's kind, which is how `bash .ci/run quick` selects (`-m unit`); a unit test
that starts an interpreter fails, so the quick loop stays in-process and quick.

Property tests (hypothesis) draw the same examples on every run, so a run's result depends on the
code alone; GCPATCH_HYPOTHESIS=search draws fresh ones on each run to look for new
counterexamples, each printed with the line that reproduces it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from testkit.tempdirs import pytest_sessionfinish, pytest_sessionstart  # noqa: F401 (hooks)

KINDS = ("unit", "process", "infra", "docs")

try:
    from hypothesis import settings
except ImportError:  # an env without property tests
    pass
else:
    settings.register_profile("fixed", derandomize=True, print_blob=True)
    settings.register_profile("search", print_blob=True, database=None)
    settings.load_profile(
        "search" if os.environ.get("GCPATCH_HYPOTHESIS", "").lower() == "search" else "fixed"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).parts
        kind = next((k for k in KINDS if "tests" in parts and k in parts), None)
        if kind is not None:
            item.add_marker(kind)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_interpreter(request, monkeypatch):
    """A unit test runs in the test's own interpreter: starting another one is a process test."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refused(*args, **kwargs):
        raise AssertionError(
            "a unit test started a process: move it to tests/process/ (it starts interpreters)"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refused)
