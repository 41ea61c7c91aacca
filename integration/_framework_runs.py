"""Helpers of the framework-CLI runs: the framework CLIs and scripts of the axolotl / colossalai integration tests.

As in `_run.py` (whose `Run` and `child_env` this reuses): every run is a process of this venv (a
script started warm, a framework CLI fresh), its cwd a temporary directory, HF_HUB_OFFLINE=1, plainly (GCPATCH=0) or with GCPATCH=1 and
GCPATCH_RECORD=<dir>; nothing here imports gcpatch.

- `build_tiny(dir)`: the tiny Llama + tokenizer (save_pretrained) + alpaca JSONL the runs load
  (scripts/make_tiny_llama.py, run plainly).
- `run_axolotl(...)`: `axolotl train cfg.yml --launcher python` exactly as a user types it (the venv's
  bin first on PATH), the config a template of configs/axolotl/ with @TINY@ filled in. The config names
  the Axolotl plugin scripts/axolotl_grad_dump.py (scripts/ on PYTHONPATH), which writes the first
  step's gradients to $GRAD_DUMP; the run's `result` is that dump ({} when Axolotl never trained).
- `Pool`: runs shared by the tests of one module, started in the background, each run once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from _run import SCRIPTS, Run, Spec, child_env, harness_run, parse_results

CONFIGS = Path(__file__).resolve().parent / "configs"
AXOLOTL_TIMEOUT_S = 600


def build_tiny(out: Path) -> Path:
    """Build the tiny model, tokenizer and dataset under `out` (a plain run: GCPATCH=0)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "make_tiny_llama.py"), str(out)],
        cwd=out.parent,
        env=child_env(GCPATCH="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "RESULT " in proc.stdout, (
        f"make_tiny_llama failed\n{proc.stdout}\n{proc.stderr}"
    )
    return out


def axolotl_env(gcpatch: bool, record_dir: Path, **extra: str) -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)
    return child_env(
        GCPATCH="1" if gcpatch else "0",
        GCPATCH_RECORD=str(record_dir),
        WANDB_MODE="disabled",
        AXOLOTL_DO_NOT_TRACK="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=str(SCRIPTS),
        PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
        **extra,
    )


def run_axolotl(
    config: str, tiny: Path, workdir: Path, gcpatch: bool, env: dict[str, str] | None = None
) -> Run:
    """`[GCPATCH=1] axolotl train <config> --launcher python` in `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / config
    cfg.write_text((CONFIGS / "axolotl" / config).read_text().replace("@TINY@", str(tiny)))
    record_dir, dump = workdir / "gcpatch-record", workdir / "grads.json"
    spec = Spec(
        f"axolotl train {config}",
        ("--launcher", "python"),
        gcpatch,
        tuple(sorted((env or {}).items())),
    )
    start = time.monotonic()
    proc = subprocess.run(
        ["axolotl", "train", config, "--launcher", "python"],
        cwd=workdir,
        env=axolotl_env(gcpatch, record_dir, GRAD_DUMP=str(dump), **(env or {})),
        capture_output=True,
        text=True,
        timeout=AXOLOTL_TIMEOUT_S,
    )
    run = Run(spec, proc.returncode, proc.stdout, proc.stderr, record_dir, time.monotonic() - start)
    if dump.exists():
        run.result = json.loads(dump.read_text())
        run.results = [run.result]
    return run


def run_script_args(
    script: str, args: list[str], workdir: Path, gcpatch: bool, env: dict[str, str] | None = None
) -> Run:
    """One integration script (scripts/<script>) with explicit arguments; parses its RESULT line."""
    workdir.mkdir(parents=True, exist_ok=True)
    record_dir = workdir / "gcpatch-record"
    spec = Spec(script, tuple(args), gcpatch, tuple(sorted((env or {}).items())))
    start = time.monotonic()
    proc = harness_run(
        [sys.executable, str(SCRIPTS / script), *args],
        workdir,
        child_env(GCPATCH="1" if gcpatch else "0", GCPATCH_RECORD=str(record_dir), **(env or {})),
        300,
        warm=True,
    )
    run = Run(spec, proc.returncode, proc.stdout, proc.stderr, record_dir, time.monotonic() - start)
    results = parse_results(proc.stdout)
    if len(results) == 1:
        run.result, run.results = results[0], results
    return run


def gcpatch_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m gcpatch <args>` of this venv (the installed gcpatch), from a neutral cwd."""
    return subprocess.run(
        [sys.executable, "-m", "gcpatch", *args],
        cwd=Path(sys.executable).parent,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )


QUIET = {"gcpatch_file", "torch", "transformers", "colossalai", "model_class", "max_grad_norm"}


class Pool:
    """Runs keyed by name, each started once in the background and shared by every test that asks."""

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers)
        self.futures: dict[str, Future] = {}

    def submit(self, key: str, fn: Callable[[], Run]) -> None:
        if key not in self.futures:
            self.futures[key] = self._pool.submit(fn)

    def get(self, key: str) -> Run:
        return self.futures[key].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def summary(self) -> list[str]:
        out = []
        for key, future in self.futures.items():
            if future.done() and not future.cancelled() and future.exception() is None:
                run = future.result()
                figures = {
                    k: v
                    for k, v in run.result.items()
                    if k not in QUIET and (not isinstance(v, (dict, list)) or k == "grad_none")
                }
                out.append(f"{run.wall_s:5.1f}s rc={run.returncode}  {key}  {figures}")
        return out


def report(request, what: str, pool: Pool) -> None:
    """One line per run (wall time, exit status, figures) on the terminal, at the session's end."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        for line in pool.summary():
            reporter.write_line(f"{what} run {line}")


def workers() -> int:
    return int(os.environ.get("GCPATCH_IT_WORKERS", "0")) or max(1, min(4, os.cpu_count() or 1))


def max_abs_diff(got: dict[str, list[float]], ref: dict[str, list[float]]) -> dict[str, float]:
    """Per trainable tensor: the largest absolute difference between two gradient dumps."""
    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
    return {
        name: max((abs(a - b) for a, b in zip(got[name], ref[name])), default=0.0) for name in ref
    }


def output(run: Run) -> str:
    return run.stdout + "\n" + run.stderr


def tail(run: Run, chars: int = 6000) -> str:
    return f"{run.spec.label()} rc={run.returncode} ({run.wall_s:.1f} s)\n{output(run)[-chars:]}"
