"""Fixtures of the integration suite: every script run is a subprocess, run at most once per
session and shared by the tests that read it. The runs a test module lists in `RUNS` are
started in the background as soon as the first test asks for one, as many at a time as there
are CPU cores; each starts warm where it can (tests/kit/testkit/warm_starts.py: a fork of an interpreter that
has already imported the frameworks, which are most of a tiny run's cost)."""

from __future__ import annotations

import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from _run import Run, Spec, run_script, warm_starts_summary
from testkit.tempdirs import pytest_sessionfinish, pytest_sessionstart  # noqa: F401 (hooks)


class ScriptRuns:
    def __init__(self, base: Path, workers: int) -> None:
        self._base = base
        self._pool = ThreadPoolExecutor(max_workers=workers)
        self._futures: dict[Spec, Future] = {}

    def submit(self, spec: Spec) -> Future:
        if spec not in self._futures:
            workdir = self._base / f"run{len(self._futures):02d}"
            self._futures[spec] = self._pool.submit(run_script, spec, workdir)
        return self._futures[spec]

    def get(
        self,
        script: str,
        *args: str,
        gcpatch: bool,
        env: dict[str, str] | None = None,
        launcher: str = "python",
        exit_ok: bool = True,
        blunt: bool = False,
    ) -> Run:
        """The run's RESULT; `exit_ok=False` accepts a non-zero exit (ranks that crashed after
        printing their RESULT lines, as a plain DDP failure does), otherwise only gloo's teardown
        abort after every RESULT is (`Run.exited_cleanly`); `blunt` runs it plain with the
        force-non-reentrant patch."""
        spec = Spec(
            script, tuple(args), gcpatch, tuple(sorted((env or {}).items())), launcher, blunt
        )
        run = self.submit(spec).result()
        assert (run.exited_cleanly() or not exit_ok) and run.result, (
            f"script failed or printed no single RESULT line\n{run.describe()}"
        )
        # every line gcpatch printed in a run the suite reads is whole (gcpatch/headline.py)
        problems = run.line_problems()
        assert not problems, f"{spec.label()}:\n" + "\n".join(problems)
        return run

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def script_runs(request, tmp_path_factory) -> ScriptRuns:
    workers = int(os.environ.get("GCPATCH_IT_WORKERS", "0")) or max(1, min(4, os.cpu_count() or 1))
    runs = ScriptRuns(tmp_path_factory.mktemp("scripts"), workers)
    request.config._gcpatch_script_runs = runs._futures
    # Start every run the selected tests' modules declare, plain and with gcpatch; a module some of
    # whose tests `-m` or `-k` left out (tf457's budget files) starts only what its selected tests ask.
    seen = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is not None and module not in seen:
            seen.append(module)
    partly = getattr(request.config, "_gcpatch_partly_selected", set())
    for module in seen:
        if getattr(
            module, "OUT_OF_RANGE", ""
        ):  # skipped on this release, with that reason: nothing to run
            continue
        if module.__name__ in partly:
            continue
        for spec in getattr(module, "RUNS", ()):
            runs.submit(spec)
            runs.submit(spec.plain())
    yield runs
    runs.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per script run: wall time and the RESULT figures the tests read."""
    runs = getattr(config, "_gcpatch_script_runs", None)
    if not runs:
        return
    terminalreporter.section("gcpatch integration runs")
    if warm_starts_summary():
        terminalreporter.write_line(warm_starts_summary())
    for spec, future in runs.items():
        if not future.done() or future.cancelled():
            continue
        run = future.result()
        keys = (
            "wrong",
            "applied_use_reentrant",
            "error_type",
            "losses",
            "wrong_per_step",
            "train_losses",
            "ratio_eval_gc_to_train_gc",
            "dropout_flags_unchanged",
            "loss_equal_eval_nogc",
            "use_reentrant_after",
            "tokens_equal",
        )
        figures = {k: run.result[k] for k in keys if k in run.result}
        terminalreporter.write_line(f"{run.wall_s:5.1f}s  {spec.label()}  {figures}")


# The memory-budget tests, by file name (docs/CI.md): CI runs them on the newest transformers alone
# (tf525-it); on 4.57 (tf457) only those also marked budget_all_generations, where what they prove
# differs between the generations. The full matrix runs them all (matrix/run.py --tests suite).
BUDGET_FILE = re.compile(r"test_(memory_)?budget\w*\.py")
HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path.parent == HERE and BUDGET_FILE.fullmatch(path.name):
            item.add_marker("budget")


def pytest_deselected(items):
    """The modules with a test left out: their `RUNS` start only as their selected tests ask."""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None:
            if not hasattr(item.config, "_gcpatch_partly_selected"):
                item.config._gcpatch_partly_selected = set()
            item.config._gcpatch_partly_selected.add(module.__name__)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "zero3: DeepSpeed ZeRO-3 integration runs (tox envs ds0189/ds0193/ds0198)"
    )
    config.addinivalue_line(
        "markers", "distributed: runs two processes with torch.distributed.run (gloo)"
    )
