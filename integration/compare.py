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

from _run import Run, Spec, run_script

HERE = Path(__file__).resolve().parent

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


def verdicts(run: Run) -> dict[str, str]:
    """The cells of one run: what went wrong, or 'correct'; one per case where the script runs
    several cases in one process (a RESULT holding a dict of figures per case), else one ("")."""
    if not run.results:
        return {"": f"no result (exit {run.returncode})"}
    cases = _cases(run.results[0])
    out = {}
    for case in cases or [""]:
        problems: list[str] = []
        for result in run.results:
            problems += _problems(_case(result, case) if case else result)
        if run.returncode != 0 and not problems:
            problems.append(f"exit {run.returncode}")
        unique = list(dict.fromkeys(problems))
        out[case] = "; ".join(unique) if unique else "correct"
    return out


def _cases(result: dict) -> list[str]:
    """The cases of a script that reports figures per case (`{case: {"wrong": ..}, ...}`)."""
    nested = result.get("cases") if isinstance(result.get("cases"), dict) else result
    found = [
        k
        for k, v in nested.items()
        if isinstance(v, dict) and ({"wrong", "error"} & set(v) or "trainable" in v)
    ]
    return [f"cases.{k}" if nested is not result else k for k in found]


def _case(result: dict, case: str) -> dict:
    for part in case.split("."):
        result = result[part]
    return result


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


def label(spec: Spec, case: str = "") -> str:
    launcher = "" if spec.launcher == "python" else f" [{spec.launcher}]"
    args = " ".join(a for a in spec.args if "," not in a or not case)  # a case list: the case
    shown = f"`{spec.script} {args}`".replace(" `", "`")
    return shown + (f" {case.rsplit('.', 1)[-1]}" if case else "") + launcher


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
        found = {key: verdicts(future.result()) for key, future in futures.items()}
    rows = [
        (spec, case)
        for spec in todo
        for case in dict.fromkeys(c for mode in MODES for c in found[(spec, mode)])
    ]
    cells = {
        (spec, case, mode): found[(spec, mode)].get(case, "not run")
        for spec, case in rows
        for mode in MODES
    }
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
    lines += [
        f"| {label(s, c)} | " + " | ".join(cells[(s, c, m)] for m in MODES) + " |" for s, c in rows
    ]
    worse = {
        mode: [
            (s, c)
            for s, c in rows
            if cells[(s, c, "gcpatch")] != "correct" and cells[(s, c, mode)] == "correct"
        ]
        for mode in ("plain", "blunt")
    }
    for mode, name in (("plain", "plain"), ("blunt", "the blunt patch")):
        lines.append(
            f"gcpatch worse than {name} on correctness: {len(worse[mode])} set-up(s)"
            + (": " + ", ".join(label(s, c) for s, c in worse[mode]) if worse[mode] else ".")
        )
    lines.insert(len(lines) - 2, "")
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
    return 1 if worse["plain"] or worse["blunt"] else 0


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
