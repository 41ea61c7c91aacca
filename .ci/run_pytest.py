"""pytest as every tox env runs it: the same arguments, and exit code 5 ("no tests collected", as
when a `-k` passed to every env selects nothing in one of them) said in one line and taken as a
pass; any other code is pytest's own. Where pytest-timeout is installed (every tox env), no test
may run longer than GCPATCH_TEST_TIMEOUT_S (default 1800 s): a hang fails that test with its stack
instead of holding the whole run until CI's limit. The ten slowest tests are listed after each env
(`--durations=10`): where CI's time goes is read off every run."""

from __future__ import annotations

import importlib.util
import os
import sys

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


if __name__ == "__main__":
    code = pytest.main(arguments(sys.argv[1:]))
    if code == NO_TESTS_COLLECTED:
        print(
            f"pytest collected no test from: {' '.join(sys.argv[1:])} (nothing to run in this env)"
        )
        code = 0
    raise SystemExit(int(code))
