"""Side by side, on every set-up the integration suite has in this environment: the plain run,
the blunt fix many scripts carry (force `use_reentrant=False` inside `torch.utils.checkpoint`,
integration/blunt/sitecustomize.py), and gcpatch (GCPATCH=1).

    python integration/compare.py                  # prints the table, writes integration/comparison/<stack>.md
    python integration/compare.py --out -          # prints only

It runs each test module's `RUNS` in the three ways with the suite's own runner and reads each
script's RESULT line: a crash, gradients that differ from the no-checkpointing reference, memory
not saved, a layer run more often than forward + one recompute, a user's choice not kept.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _run import Run, Spec, run_script  # noqa: E402

MODES = ("plain", "blunt", "gcpatch")


def specs() -> list[Spec]:
    """Every gcpatch run the importable test modules declare (modules whose framework is missing
    here skip themselves at import)."""
    found: list[Spec] = []
    for path in sorted(HERE.glob("test_*.py")):
        try:
            module = importlib.import_module(path.stem)
        except BaseException as exc:  # noqa: BLE001 (pytest.skip at import raises a BaseException)
            print(
                f"skipped {path.name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                file=sys.stderr,
            )
            continue
        runs = getattr(module, "RUNS", ())
        for spec in runs.values() if isinstance(runs, dict) else runs:
            if (
                not dict(spec.env).get("GCPATCH_MODE") and spec not in found
            ):  # the default mode only
                found.append(spec)
    return found


def variant(spec: Spec, mode: str) -> Spec:
    return {"plain": spec.plain, "blunt": spec.forced_non_reentrant, "gcpatch": lambda: spec}[
        mode
    ]()


def verdict(run: Run) -> str:
    """One cell: what went wrong in this run, or 'correct'."""
    if not run.results:
        return f"no result (exit {run.returncode})"
    problems: list[str] = []
    for result in run.results:
        problems += _problems(result)
    if run.returncode != 0 and not problems:
        problems.append(f"exit {run.returncode}")
    unique = list(dict.fromkeys(problems))
    return "; ".join(unique) if unique else "correct"


def _problems(r: dict) -> list[str]:
    if r.get("skipped"):
        return [f"skipped: {r['skipped']}"]
    error = r.get("error") or (r.get("error_type") and f"{r['error_type']}:")
    if error:
        return [f"crash: {_short(error)}"]
    out = []
    steps = r.get("steps") or [r]
    wrong = max(
        (s.get("wrong") or s.get("grads_wrong") or s.get("wrong_grads") or 0) for s in steps
    )
    if wrong:
        out.append(f"{wrong} of {steps[0].get('trainable', '?')} gradients wrong")
    if any(s.get("loss_equal") is False for s in steps):
        out.append("loss differs")
    ratio = r.get("ratio_eval_gc_to_train_gc")
    if ratio is not None and ratio > 1.1:
        out.append(f"eval mode saves no memory ({ratio:.2f}x train-mode bytes)")
    if r.get("tokens_equal") is False:
        out.append("generate() tokens differ")
    runs = r.get("max_layer_runs") or r.get("inner_runs_per_block")
    if runs and runs > 2:
        out.append(f"layers run {runs:g}x a step")
    asked = r.get("asked_use_reentrant")
    if asked in (True, False) and r.get("use_reentrant_after") not in (asked, None):
        out.append(f"user's use_reentrant={asked} lost ({r.get('use_reentrant_after')})")
    if r.get("losses_finite") is False:
        out.append("non-finite loss")
    return out


def _short(error: str) -> str:
    kind, _, text = error.partition(":")
    return f"{kind} ({text.strip()[:60]}...)" if text.strip() else kind


def label(spec: Spec) -> str:
    launcher = "" if spec.launcher == "python" else f" [{spec.launcher}]"
    return f"`{spec.script} {' '.join(spec.args)}`{launcher}".replace(" `", "`")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=None,
        help="a file, or - to print only "
        "(default: integration/comparison/<stack>.md, the stack named by its versions)",
    )
    parser.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    args = parser.parse_args()
    todo = specs()
    base = Path(tempfile.mkdtemp(prefix="gcpatch-compare-"))
    with ThreadPoolExecutor(args.workers) as pool:
        futures = {
            (spec, mode): pool.submit(run_script, variant(spec, mode), base / f"run{i:03d}{mode}")
            for i, spec in enumerate(todo)
            for mode in MODES
        }
        cells = {key: verdict(future.result()) for key, future in futures.items()}
    versions = ", ".join(
        f"{d} {_version(d)}"
        for d in ("torch", "transformers", "peft", "trl", "deepspeed", "axolotl", "colossalai")
        if _version(d)
    )
    lines = [
        f"Measured with {versions}, Python {platform.python_version()}; "
        "regenerate with `python integration/compare.py` in a tox env (`.tox/<env>/bin/python`).",
        "",
        "| set-up | plain | force non-reentrant | gcpatch |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {label(s)} | " + " | ".join(cells[(s, m)] for m in MODES) + " |" for s in todo]
    worse = [
        s for s in todo if cells[(s, "gcpatch")] != "correct" and cells[(s, "blunt")] == "correct"
    ]
    lines += [
        "",
        f"gcpatch worse than the blunt patch on correctness: {len(worse)} set-up(s)"
        + (": " + ", ".join(label(s) for s in worse) if worse else "."),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out != "-":
        stack = "-".join(
            f"{d}{_version(d)}"
            for d in ("transformers", "deepspeed", "axolotl", "colossalai")
            if _version(d)
        )
        out = Path(args.out) if args.out else HERE / "comparison" / f"{stack}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return 1 if worse else 0


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
