"""The transformers version matrix: one command builds (or reuses) one environment per release
pair of matrix/releases.csv, runs the same tests on each, and writes matrix/results.json and the
table matrix/RESULTS.md (release x rule -> pass / skip with reason / fail / not run).

    python matrix/run.py                      # every cell, the core selection
    python matrix/run.py --cells 4.43.4,5.17.0 --tests full
    python matrix/run.py --cells 4.57.6,4.35.2 --tests suite   # what CI's tf457/tf4352 ran before they kept the core
    python matrix/run.py --cells missing      # resume: the cells without a result for the selected columns
    python matrix/run.py --cells missing --tests "P1 QLoRA,T1 TRL,R4 DDP,F2 FSDP"   # the extra columns where not run
    python matrix/run.py --cells none --pythons 3.9,3.10,3.12,3.13   # the framework-free suite there
    python matrix/run.py --render             # only re-render RESULTS.md from results.json

Environments live outside the repository ($GCPATCH_MATRIX_ENVS, default ~/.cache/gcpatch-matrix) and
are reused between runs: one base venv holds torch 2.13 (CPU) and the test tools, and each cell is
a small venv that sees the base through a .pth file and holds only its own transformers, peft,
trl and accelerate. A cell is rebuilt only when its pins change. gcpatch itself is built once per
run and installed into each cell (--no-deps --force-reinstall), as the integration tests need.
The cells run on Python 3.11 (the only Python torch 2.13's CPU wheel exists for, see docs/CI.md); other
Pythons run the framework-free suite (--pythons).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASES = ROOT / "matrix" / "releases.csv"
RESULTS_JSON = ROOT / "matrix" / "results.json"
RESULTS_MD = ROOT / "matrix" / "RESULTS.md"
PYTHON = os.environ.get("GCPATCH_MATRIX_PYTHON", shutil.which("python3.11") or sys.executable)
BASE_REQS = [
    "torch==2.13.0",
    "pytest>=7",
    "hypothesis",
    "bitsandbytes==0.50.*",
    "wrapt",
    "pluggy",
    "packaging",
]

# What each column of the table proves, and the tests that prove it (the same files on every cell).
RULES: list[tuple[str, str, list[str]]] = [
    (
        "patch points",
        "X1 entry points once, restored by identity",
        ["tests/process/test_patch_points.py"],
    ),
    ("canaries", "shape of every upstream patch point", ["tests/unit/test_canaries.py"]),
    (
        "R1 frozen",
        "R1 partially frozen + reentrant, input_ids and inputs_embeds",
        ["integration/test_frozen_gradients.py"],
    ),
    ("P4 LoRA", "P4 LoRA + inputs_embeds, both orders", ["integration/test_lora_embeds.py"]),
    (
        "R5 eval",
        "R5 eval-mode model checkpoints, same results",
        ["integration/test_eval_mode.py", "integration/test_eval_mode_llama.py"],
    ),
    (
        "X3 Trainer",
        "X3 Trainer re-enable keeps the user's ask",
        ["integration/test_trainer_reenable.py", "integration/test_trainer_gradients.py"],
    ),
    (
        "X1 args",
        "every argument of the enable call survives",
        ["integration/test_enable_arguments.py"],
    ),
    ("P1 QLoRA", "P1 4-bit + reentrant", ["integration/test_qlora_4bit.py"]),
    ("T1 TRL", "TRL SFT + PEFT", ["integration/test_trl_peft.py"]),
    ("R4 DDP", "R4 DDP find_unused over 2 ranks", ["integration/test_ddp_unused.py"]),
    (
        "F2 FSDP",
        "F2 reentrant recompute that encloses FSDP's unshard all-gathers again",
        ["integration/test_fsdp_all_gather.py"],
    ),
    # what CI's tox env of a release ran before CI kept only the core columns on 4.57 and the oldest
    ("suite", "the whole suite, every unit and integration test", ["tests", "integration"]),
]
CORE = ["patch points", "canaries", "R1 frozen", "P4 LoRA", "R5 eval", "X3 Trainer", "X1 args"]
CI_CELLS = ("oldest", "4.57.6", "newest")


def releases() -> list[dict[str, str]]:
    with RELEASES.open() as fh:
        return list(csv.DictReader(fh))


def envs_dir() -> Path:
    """$GCPATCH_MATRIX_ENVS, else the user's cache directory (several GB: a venv per release)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("GCPATCH_MATRIX_ENVS") or cache / "gcpatch-matrix")


def sh(
    cmd: list[str], log: Path | None = None, timeout: int = 1800, **kw
) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if log is not None:
        with log.open("a") as fh:
            fh.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    return proc


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def base_env(log: Path) -> Path:
    base = envs_dir() / "base"
    marker = base / "matrix-base.txt"
    if marker.exists() and marker.read_text() == "\n".join(BASE_REQS):
        return base
    shutil.rmtree(base, ignore_errors=True)
    sh([PYTHON, "-m", "venv", str(base)], log)
    proc = sh(
        [
            str(base / "bin" / "pip"),
            "install",
            "-q",
            "-c",
            str(ROOT / "constraints.txt"),
            *BASE_REQS,
        ],
        log,
    )
    if proc.returncode:
        raise SystemExit(f"base environment failed, see {log}")
    marker.write_text("\n".join(BASE_REQS))
    return base


def cell_reqs(row: dict[str, str]) -> list[str]:
    return [
        f"transformers=={row['transformers']}",
        f"peft=={row['peft']}",
        f"trl=={row['trl']}",
        f"accelerate=={row['accelerate']}",
        "datasets>=2.18",
    ] + (
        # accelerate < 1.0 pins numpy < 2, and newer pyarrow (datasets) refuses numpy 1.x at import
        # time without declaring it: keep pyarrow where both numpy generations work
        ["pyarrow<21"] if int(row["accelerate"].split(".")[0]) < 1 else []
    )


def cell_env(row: dict[str, str], base: Path, log: Path) -> tuple[Path | None, str]:
    """The cell's venv (reused when its pins are unchanged), or None and the installer's error."""
    venv = envs_dir() / f"tf-{row['transformers']}"
    marker = venv / "matrix-cell.txt"
    reqs = cell_reqs(row)
    if marker.exists() and marker.read_text() == "\n".join(reqs):
        return venv, ""
    shutil.rmtree(venv, ignore_errors=True)
    sh([PYTHON, "-m", "venv", str(venv)], log)
    (site_packages(venv) / "_matrix_base.pth").write_text(str(site_packages(base)) + "\n")
    proc = sh(
        [str(venv / "bin" / "pip"), "install", "-q", "-c", str(ROOT / "constraints.txt"), *reqs],
        log,
    )
    if proc.returncode:
        return None, "pip: " + _last_error(proc.stderr)
    marker.write_text("\n".join(reqs))
    return venv, ""


def _last_error(text: str) -> str:
    lines = [
        line
        for line in text.splitlines()
        if line.strip() and not line.startswith("WARNING: Location")
    ]
    errors = [line for line in lines if "Error" in line or "ERROR" in line]
    return (errors[-1] if errors else (lines[-1] if lines else "no output")).strip()[:300]


SMOKE = """
import torch, transformers
from transformers import LlamaConfig, LlamaForCausalLM
m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2))
m.train(); m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
ids = torch.randint(0, 64, (1, 8)); m(input_ids=ids, labels=ids).loss.backward()
print("SMOKE", transformers.__version__, torch.__version__)
"""


def smoke(venv: Path, log: Path) -> str:
    """'' when the release builds, trains and checkpoints a tiny Llama on this torch; else the error."""
    proc = sh(
        [str(venv / "bin" / "python"), "-c", SMOKE],
        log,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "GCPATCH": "0"},
    )
    return "" if proc.returncode == 0 and "SMOKE" in proc.stdout else _last_error(proc.stderr)


def code_version() -> str:
    """The gcpatch commit the wheel is built from (`-dirty`: with uncommitted changes besides the
    results files this runner writes), recorded with every column a run proves, so the table says
    which code each cell proved."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True
        ).stdout.strip()

    commit = git("rev-parse", "--short=7", "HEAD") or "unknown"
    changed = git(
        "status",
        "--porcelain",
        "--",
        ".",
        f":!{RESULTS_JSON.relative_to(ROOT)}",
        f":!{RESULTS_MD.relative_to(ROOT)}",
    )
    return f"{commit}-dirty" if changed else commit


def build_gcpatch(log: Path) -> Path:
    out = envs_dir() / f"wheel-{os.getpid()}"  # one per run: runs may overlap
    shutil.rmtree(out, ignore_errors=True)
    proc = sh(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)], log
    )
    if proc.returncode:
        raise SystemExit(f"building gcpatch failed, see {log}")
    return next(out.glob("gcpatch-*.whl"))


def run_cell(
    row: dict[str, str], columns: list[str], wheel: Path, base: Path, logs: Path, code: str
) -> dict:
    version = row["transformers"]
    log = logs / f"tf-{version}.log"
    log.unlink(missing_ok=True)
    start = time.monotonic()
    cell: dict = {
        "transformers": version,
        "peft": row["peft"],
        "trl": row["trl"],
        "python": row["python"],
        "torch": row["torch"],
        "rules": {},
    }
    venv, error = cell_env(row, base, log)
    if venv is not None:
        error = smoke(venv, log)
    if error:
        cell["unsupported"] = error
        cell["wall_s"] = round(time.monotonic() - start, 1)
        return cell
    sh(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        log,
    )
    files = list(
        dict.fromkeys(
            f for name, _, fs in RULES if name in columns for f in fs if (ROOT / f).exists()
        )
    )
    junit = logs / f"tf-{version}.xml"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "GCPATCH_IT_WORKERS": os.environ.get("GCPATCH_IT_WORKERS", "1"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("GCPATCH", None)
    sh(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *files,
        ],
        log,
        timeout=3600,
        cwd=ROOT,
        env=env,
    )
    cell["rules"] = {
        name: {**result, "code": code} for name, result in summarise(junit, columns).items()
    }
    cell["wall_s"] = round(time.monotonic() - start, 1)
    return cell


# The same files as tox.ini's py39 ... py313 envs (tests/docs/test_matrix_table.py keeps the two the same).
FRAMEWORK_FREE = [
    "tests/process/test_activation.py",
    "tests/unit/test_resolve.py",
    "tests/process/test_version_ranges.py",
    "tests/unit/test_canaries.py",
    "tests/process/test_plugin_failures.py",
    "tests/process/test_patch_points.py",
    "tests/docs/test_matrix_table.py",
    "tests/unit/test_import_layers.py",
    "tests/process/test_cli.py",
    "tests/process/test_packaging.py",
    "tests/infra/test_ci_script.py",
    "tests/unit/test_plugin_api.py",
]


def interpreter(version: str) -> str | None:
    """Python `version` (e.g. "3.9"): $GCPATCH_PY39 as in tox.ini, else pyenv's newest of that minor."""
    found = os.environ.get("GCPATCH_PY" + version.replace(".", ""))
    if found:
        return found
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = sorted(root.glob(f"{version}.*/bin/python{version}"))
    return str(candidates[-1]) if candidates else shutil.which(f"python{version}")


def run_python_cell(version: str, wheel: Path, logs: Path) -> dict:
    """The framework-free suite on another Python (no torch 2.13 CPU build exists for it)."""
    log = logs / f"py{version}.log"
    log.unlink(missing_ok=True)
    cell = {
        "python": version,
        "torch": "none (no CPU build on the registry)",
        "what": "framework-free suite: "
        + ", ".join(f"`{f.split('/')[-1]}`" for f in FRAMEWORK_FREE),
    }
    exe = interpreter(version)
    if exe is None:
        return {**cell, "result": "not run: interpreter not found"}
    venv = envs_dir() / f"py{version}"
    if not (venv / "bin" / "python").exists():
        sh([exe, "-m", "venv", str(venv)], log)
    sh(
        [
            str(venv / "bin" / "pip"),
            "install",
            "-q",
            "pytest>=7",
            "hypothesis",
            "wrapt",
            "pluggy",
            "packaging",
        ],
        log,
    )
    sh(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        log,
    )
    junit = logs / f"py{version}.xml"
    # results.json changes while the matrix runs: whether RESULTS.md matches it is checked by tox, not here
    stale = "--deselect=tests/docs/test_matrix_table.py::test_committed_results_table_is_the_rendered_results"
    proc = sh(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            stale,
            *FRAMEWORK_FREE,
        ],
        log,
        timeout=1800,
        cwd=ROOT,
    )
    exact = sh(
        [str(venv / "bin" / "python"), "-c", "import sys; print(sys.version.split()[0])"]
    ).stdout.strip()
    counts = {"pass": 0, "skip": 0, "fail": 0}
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            tags = {child.tag for child in case}
            counts[
                "fail" if tags & {"failure", "error"} else "skip" if "skipped" in tags else "pass"
            ] += 1
    result = f"{counts['pass']} passed, {counts['skip']} skipped (framework tests: not installed), {counts['fail']} failed"
    if not junit.exists():
        result = f"not run: pytest exited {proc.returncode}"
    return {**cell, "python": exact or version, "result": result}


def summarise(junit: Path, columns: list[str]) -> dict[str, dict]:
    """{column: {"state": pass|skip|fail, ...}} from pytest's JUnit XML."""
    cases: dict[str, list[tuple[str, str, str]]] = {}
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            path = case.get("classname", "").replace(".", "/")
            outcome, detail = "pass", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, detail = "fail", (child.get("message") or "")[:200]
                elif child.tag == "skipped":
                    outcome, detail = (
                        "skip",
                        (child.get("message") or "").removeprefix("Skipped: ")[:200],
                    )
            cases.setdefault(path, []).append((case.get("name", ""), outcome, detail))
    out = {}
    for name, _, files in RULES:
        if name not in columns:
            continue
        got = [
            c
            for f in files
            for key, cs in cases.items()
            if key == f.removesuffix(".py") or key.startswith(f + "/")
            for c in cs
        ]
        if not got:
            out[name] = {
                "state": "fail" if junit.exists() else "not run",
                "detail": "no test collected",
            }
            continue
        fails = [c for c in got if c[1] == "fail"]
        passes = [c for c in got if c[1] == "pass"]
        skips = [c for c in got if c[1] == "skip"]
        if fails:
            out[name] = {
                "state": "fail",
                "n": len(fails),
                "of": len(got),
                "detail": f"{fails[0][0]}: {fails[0][2]}",
            }
        elif passes:
            out[name] = {
                "state": "pass",
                "n": len(passes),
                "skipped": sorted({c[2] for c in skips}),
            }
        else:
            out[name] = {"state": "skip", "detail": sorted({c[2] for c in skips})[0]}
    return out


def save(key: str, value: object) -> dict:
    """Merge one cell into results.json as it is on disk now (another run may have written since)."""
    results = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    results[key] = value
    RESULTS_JSON.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    RESULTS_MD.write_text(
        render(results)
    )  # the two files always agree (tests/docs/test_matrix_table.py)
    return results


def _clean(text: str, limit: int = 140) -> str:
    """One table-safe line."""
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render(results: dict) -> str:
    rows = releases()
    lines = [
        "# transformers version matrix: results",
        "",
        "Generated by `python matrix/run.py` (see [docs/CI.md](../docs/CI.md)); the release pairs and where",
        "each came from are in [releases.csv](releases.csv). Each cell ran the same test files; a rule",
        "that does not apply on a release is skipped with a reason derived from its version. `not run`: no",
        "result recorded for that cell yet (the command runs it). `gcpatch`: the commit of gcpatch the",
        "release's columns ran against (`-dirty`: with uncommitted changes; `-`: a run from before the",
        "runner recorded it).",
        "",
    ]
    lines += [_summary(rows, results), "", "| column | what it proves | tests |", "|---|---|---|"]
    lines += [
        f"| {n} | {what} | {', '.join(f'`{f}`' for f in files)} |" for n, what, files in RULES
    ]
    names = [n for n, _, _ in RULES]
    lines += [
        "",
        "| transformers | peft | trl | python | " + " | ".join(names) + " | time | gcpatch |",
        "|---" * (len(names) + 6) + "|",
    ]
    for row in rows:
        cell = results.get(row["transformers"])
        head = f"| {row['transformers']} | {row['peft']} | {row['trl']} | {row['python']} |"
        if cell is None:
            lines.append(head + " not run |" * len(names) + " | |")
            continue
        if cell.get("unsupported"):
            lines.append(
                head
                + f" **unsupported on torch {cell['torch']}**: {_clean(cell['unsupported'])} |"
                + " |" * (len(names) - 1)
                + f" {cell['wall_s']:.0f} s | {_codes(cell)} |"
            )
            continue
        parts = []
        for n in names:
            r = cell["rules"].get(n)
            if r is None or r["state"] == "not run":
                parts.append("not run")
            elif r["state"] == "pass":
                parts.append(
                    f"pass ({r['n']})"
                    + ("; skip: " + _clean("; ".join(r["skipped"]), 200) if r["skipped"] else "")
                )
            elif r["state"] == "skip":
                parts.append(f"skip: {_clean(r['detail'])}")
            else:
                parts.append(
                    f"**FAIL** ({r.get('n', '?')}/{r.get('of', '?')}): {_clean(r['detail'])}"
                )
        lines.append(
            head + "".join(f" {p} |" for p in parts) + f" {_time(cell)} | {_codes(cell)} |"
        )
    extra = results.get("_python")
    if extra:
        lines += [
            "",
            "## Other Pythons",
            "",
            "| python | torch | what ran | result |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {p['python']} | {p['torch']} | {p['what']} | {_clean(p['result'])} |" for p in extra
        ]
    return "\n".join(lines) + "\n"


def _summary(rows: list[dict[str, str]], results: dict) -> str:
    """One line: how many releases have results, and the table's cells by state."""
    names = [n for n, _, _ in RULES]
    counts = {"pass": 0, "skip": 0, "fail": 0, "not run": 0}
    ran = unsupported = 0
    for row in rows:
        cell = results.get(row["transformers"])
        if cell is None:
            counts["not run"] += len(names)
            continue
        ran += 1
        if cell.get("unsupported"):
            unsupported += 1
            continue
        for n in names:
            counts[cell["rules"].get(n, {}).get("state", "not run")] += 1
    return (
        f"**{ran} of {len(rows)} releases run** ({unsupported} unsupported); release x rule cells: "
        + ", ".join(f"{v} {k}" for k, v in counts.items())
        + "."
    )


def _codes(cell: dict) -> str:
    """The gcpatch commits the release's columns ran against, each with how many columns."""
    counts: dict[str, int] = {}
    for result in cell.get("rules", {}).values():
        if result.get("state") != "not run":
            counts[result.get("code", "-")] = counts.get(result.get("code", "-"), 0) + 1
    return ", ".join(
        f"{code} ({n})" for code, n in sorted(counts.items(), key=lambda item: item[0] == "-")
    )


def _time(cell: dict) -> str:
    """The cell's wall time: one figure per selection run on it (a cell's columns may come from
    several runs, e.g. the core selection, then the extra columns), else the last run's."""
    timing = cell.get("timing") or {}
    if not timing:
        return f"{cell['wall_s']:.0f} s"
    return " + ".join(
        f"{s:.0f} s {label.replace(',', '/')}"
        for label, s in sorted(timing.items(), key=lambda item: item[0] != "core")
    )


def newest_listed(index_output: str) -> str | None:
    """The release `pip index versions transformers` names first ("transformers (5.25.0)")."""
    first = index_output.strip().splitlines()[0] if index_output.strip() else ""
    if "(" not in first or not first.endswith(")"):
        return None
    return first.rsplit("(", 1)[1][:-1]


def newest_check() -> int:
    """Whether matrix/releases.csv has transformers' newest release; if not, what to run."""
    proc = subprocess.run(
        [PYTHON, "-m", "pip", "index", "versions", "transformers"],
        capture_output=True,
        text=True,
    )
    newest = newest_listed(proc.stdout)
    if newest is None:
        print(f"the package index did not answer: {proc.stderr.strip()[-300:]}")
        return 2
    listed = releases()[-1]["transformers"]
    if newest == listed:
        print(f"transformers {newest}, the newest release, is the table's newest row")
        return 0
    print(
        f"transformers {newest} is out; the table ends at {listed}. Add its row to"
        " matrix/releases.csv (the peft, trl and accelerate releases of its day), pin tox's newest"
        f" env to it, run `python3.11 matrix/run.py --cells {newest} --tests full` and raise the"
        " transformers plugin's proven range"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cells",
        default="all",
        help="'all', 'ci' (oldest, 4.57.6, newest), 'missing' (those without a result for every "
        "selected column), 'none', or versions, comma-separated",
    )
    parser.add_argument(
        "--tests",
        default="core",
        help="'core', 'full' (every rule column), 'suite' (the whole suite) or column names, comma-separated",
    )
    parser.add_argument(
        "--pythons",
        default="",
        help="other Pythons for the framework-free suite, e.g. 3.9,3.10,3.12,3.13 "
        "(with --cells all: these four unless given)",
    )
    parser.add_argument("--render", action="store_true", help="only re-render RESULTS.md")
    parser.add_argument(
        "--newest",
        action="store_true",
        help="only ask the package index for transformers' newest release: exit 1 if the table"
        " lacks it (run weekly: the matrix follows a release within a week)",
    )
    args = parser.parse_args(argv)
    if args.newest:
        return newest_check()
    results = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    pythons = [
        p
        for p in (args.pythons or ("3.9,3.10,3.12,3.13" if args.cells == "all" else "")).split(",")
        if p
    ]
    if not args.render:
        rows = releases()
        supported = [r for r in rows if r["status"] != "unsupported"]
        columns = {"core": CORE, "full": [n for n, _, _ in RULES if n != "suite"]}.get(
            args.tests
        ) or args.tests.split(",")
        unknown = sorted(set(columns) - {n for n, _, _ in RULES})
        if unknown:
            parser.error(
                f"no such column: {', '.join(unknown)} (columns: {', '.join(n for n, _, _ in RULES)})"
            )
        if args.cells == "none":
            chosen = []
        elif args.cells == "all":
            chosen = rows
        elif args.cells == "missing":
            chosen = [
                r
                for r in rows
                if not results.get(r["transformers"], {}).get("unsupported")
                and not set(columns) <= set(results.get(r["transformers"], {}).get("rules", {}))
            ]
        elif args.cells == "ci":
            chosen = [
                supported[0],
                next(r for r in rows if r["transformers"] == "4.57.6"),
                rows[-1],
            ]
        else:
            by_version = {r["transformers"]: r for r in rows}
            chosen = [by_version[v] for v in args.cells.split(",")]  # in the order given
        logs = envs_dir() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        base = base_env(logs / "base.log")
        wheel, code = build_gcpatch(logs / "wheel.log"), code_version()
        for row in chosen:
            cell = run_cell(row, columns, wheel, base, logs, code)
            on_disk = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
            previous = on_disk.get(row["transformers"], {}).get("rules", {})
            cell["rules"] = {**previous, **cell["rules"]} if not cell.get("unsupported") else {}
            cell["timing"] = {
                **on_disk.get(row["transformers"], {}).get("timing", {}),
                args.tests: cell["wall_s"],
            }
            results = save(row["transformers"], cell)
            states = {k: v["state"] for k, v in cell["rules"].items()}
            print(
                f"transformers {row['transformers']}: {cell.get('unsupported') or states} ({cell['wall_s']} s)",
                flush=True,
            )
        if pythons:
            for version in pythons:
                cell = run_python_cell(version, wheel, logs)
                print(f"python {version}: {cell['result']}", flush=True)
                on_disk = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
                done = {p["python"].rsplit(".", 1)[0]: p for p in on_disk.get("_python", [])}
                done[version] = cell
                results = save(
                    "_python",
                    [done[k] for k in sorted(done, key=lambda v: tuple(map(int, v.split("."))))],
                )
    RESULTS_MD.write_text(render(results))
    failed = [
        v
        for k, v in results.items()
        if not k.startswith("_")
        for r in v.get("rules", {}).values()
        if r["state"] == "fail"
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
