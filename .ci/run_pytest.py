"""pytest as every tox env runs it: the same arguments, and exit code 5 ("no tests collected", as
when a `-k` passed to every env selects nothing in one of them) said in one line and taken as a
pass; any other code is pytest's own."""
from __future__ import annotations

import sys

import pytest

NO_TESTS_COLLECTED = 5

if __name__ == "__main__":
    code = pytest.main(["-p", "no:cacheprovider", *sys.argv[1:]])
    if code == NO_TESTS_COLLECTED:
        print(f"pytest collected no test from: {' '.join(sys.argv[1:])} (nothing to run in this env)")
        code = 0
    raise SystemExit(int(code))
