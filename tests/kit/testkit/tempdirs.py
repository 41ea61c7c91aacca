"""No folder left behind: a test session runs with TMPDIR pointing at a folder of its own
(inherited by every interpreter it starts, warm or fresh), which must hold nothing but pytest's
own `pytest-of-<user>` when the session ends. What is left there fails the session, named; the
folder is then removed, so a leak never reaches the machine's temporary directory.

Both suites' conftest.py import these two hooks (a conftest's hooks are found by name; where one
session loads both, the first start and the first finish do the work)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

_KEY = pytest.StashKey[tuple]()
# not the suite's: pytest's last runs' tmp_path folders (kept by design), torch.compile's cache
# (torch's default place, /tmp/torchinductor_<user>), torch.distributed.run's log folders (the
# launcher makes one per run and never removes it); removed with the session's folder all the same
EXEMPT_PREFIXES = ("pytest-of-", "torchinductor_", "torchelastic_")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    if _KEY in session.stash:  # both suites' conftests in one session: one folder
        return
    folder = Path(tempfile.mkdtemp(prefix="gcpatch-tests-"))
    session.stash[_KEY] = (folder, os.environ.get("TMPDIR"))
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # recomputed from TMPDIR at the next use


def leftovers(folder: Path) -> list[str]:
    """What a session left in its temporary folder (names, sorted), pytest's own excepted."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(EXEMPT_PREFIXES))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _KEY not in session.stash:
        return
    folder, before = session.stash[_KEY]
    del session.stash[_KEY]
    warm = sys.modules.get("testkit.warm_starts")
    if warm is not None:  # the warm interpreters' folders go with them, before the count
        warm.close_all()
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    left = leftovers(folder) if folder.is_dir() else []
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        text = (
            f"tests left {len(left)} item(s) in their temporary folder (TMPDIR): "
            + ", ".join(left[:20])
            + (" ..." if len(left) > 20 else "")
        )
        if reporter is not None:
            reporter.write_line(f"FAILED no folder left behind: {text}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(folder, ignore_errors=True)
