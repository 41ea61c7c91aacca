"""pytest as every tox env runs it: the same arguments, and exit code 5 ("no tests collected", as
when a `-k` passed to every env selects nothing in one of them) said in one line and taken as a
pass; any other code is pytest's own. Where pytest-timeout is installed (every tox env), no test
may run longer than GCPATCH_TEST_TIMEOUT_S (default 1800 s): a hang fails that test with its stack
instead of holding the whole run until CI's limit. The ten slowest tests are listed after each env
(`--durations=10`): where CI's time goes is read off every run. Where $GCPATCH_CI_STATUS names a
folder (`.ci/run` makes one), the env's counts, progress and skip reasons are written there as
<env>.json, which `.ci/progress.py` reads."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

NO_TESTS_COLLECTED = 5


def arguments(argv: list[str]) -> list[str]:
    bound = []
    if importlib.util.find_spec("pytest_timeout") is not None and not any(
        a.startswith("--timeout") for a in argv
    ):
        bound = [f"--timeout={os.environ.get('GCPATCH_TEST_TIMEOUT_S', '1800')}"]
    if not any(a.startswith("--durations") for a in argv):
        bound.append("--durations=10")
    return ["-p", "no:cacheprovider", *bound, *argv]


class Status:
    """This env's counts as the tests run: written at most every few seconds, and at the end."""

    EVERY_S = 5.0

    def __init__(self, folder: Path, env: str) -> None:
        self.path = folder / f"{env}.json"
        self.data = {"env": env, "state": "collecting", "total": 0, "done": 0, "skips": []}
        self.data.update(dict.fromkeys(("passed", "failed", "errors", "skipped", "xfailed"), 0))
        self.start = self.written = time.monotonic()

    def write(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.written < self.EVERY_S:
            return
        self.written, self.data["seconds"] = now, round(now - self.start, 1)
        partial = self.path.with_suffix(".part")
        partial.write_text(json.dumps(self.data), encoding="utf-8")
        partial.replace(self.path)  # whole or not at all for the reader

    def pytest_collection_finish(self, session) -> None:
        self.data.update(state="testing", total=len(session.items))
        self.write(force=True)

    def pytest_runtest_logreport(self, report) -> None:
        data = self.data
        if report.skipped:
            if getattr(report, "wasxfail", None) is not None:
                data["xfailed"] += 1
                return
            data["skipped"] += 1
            reason = (
                report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            )
            data["skips"].append(str(reason).removeprefix("Skipped: "))
        elif report.failed:
            data["failed" if report.when == "call" else "errors"] += 1
        elif report.when == "call":
            data["passed"] += 1

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        self.data["done"] += 1
        self.write()

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self.data["state"] = "done"
        self.write(force=True)


def plugins() -> list[object]:
    folder = os.environ.get("GCPATCH_CI_STATUS")
    if not folder or not Path(folder).is_dir():
        return []
    return [Status(Path(folder), os.environ.get("TOX_ENV_NAME", "pytest"))]


if __name__ == "__main__":
    code = pytest.main(arguments(sys.argv[1:]), plugins=plugins())
    if code == NO_TESTS_COLLECTED:
        print(
            f"pytest collected no test from: {' '.join(sys.argv[1:])} (nothing to run in this env)"
        )
        code = 0
    raise SystemExit(int(code))
