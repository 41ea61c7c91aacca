"""Measuring: every figure of the benchmark, taken in fresh processes (a venv without gcpatch,
one with it, GCPATCH unset and =1), variants interleaved round by round in rotating order.
Returns raw figures only; report.py turns them into RESULTS.md."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
import timeit
from importlib import metadata
from pathlib import Path

from testkit.harness import child_env as _child_env
from testkit.harness import result_of

HERE = Path(__file__).resolve().parent

WORKER = HERE / "_worker.py"
SETUP_ORDER = ["full", "full_reentrant", "lora", "lora_embeds", "eval"]

FULL = dict(
    startup_runs=200,
    importtime_runs=30,
    import_runs=8,
    warm=True,
    enable_procs=3,
    enable_models=20,
    small_models=3,
    model=dict(
        num_hidden_layers=8,
        hidden_size=256,
        intermediate_size=688,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=1024,
    ),
    batch=1,
    seq=512,
    warmup=1,
    steps=8,
    threads=1,
    setups_per_process=1,
)
SMOKE = dict(
    startup_runs=5,
    importtime_runs=2,
    import_runs=1,
    warm=False,
    enable_procs=1,
    enable_models=2,
    small_models=1,
    model=dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=128,
    ),
    batch=1,
    seq=32,
    warmup=0,
    steps=1,
    threads=1,
    setups_per_process=len(SETUP_ORDER),
)
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=1000,
    max_position_embeddings=128,
)


def log(text: str) -> None:
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {text}\n")
    sys.stderr.flush()


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every child (tests/kit/testkit/harness.py), quiet."""
    return _child_env(quiet=True, **extra)


def run_worker(task: str, args: dict, env: dict[str, str], timeout: float = 900) -> dict:
    proc = subprocess.run(
        [sys.executable, str(WORKER), task, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=HERE,
    )
    try:
        return result_of(proc)
    except AssertionError as exc:
        raise RuntimeError(f"worker {task} failed (rc {proc.returncode})") from exc


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median of the per-round ratios of two interleaved series."""
    return med([a / b for a, b in zip(num, den) if b > 0])


def wall(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {proc.stderr.decode()[-2000:]}")
    return elapsed


def interleave(
    variants: dict[str, tuple[list[str], dict[str, str]]], runs: int, warm: bool = True
) -> dict[str, list[float]]:
    """Wall time of each variant's command, `runs` rounds, the order rotating every round."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in (
        names if warm else []
    ):  # one untimed run each: page cache and .pyc files warm for all
        wall(*variants[name])
    for round_ in range(runs):
        k = round_ % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(wall(*variants[name]))
    return times


# ---------------------------------------------------------------------------------------------
# 1. start-up, and 2. import transformers
# ---------------------------------------------------------------------------------------------


def gcpatch_files() -> tuple[Path, list[str]]:
    """The site directory gcpatch is installed in, and its top-level entries there."""
    dist = metadata.distribution("gcpatch")
    tops: set[str] = set()
    for file in dist.files or []:
        top = Path(str(file)).parts[0]
        if top not in ("..", "."):  # console scripts live outside the site directory
            tops.add(top)
    site_dir = Path(str(dist.locate_file(""))).resolve()
    return site_dir, sorted(tops)


def make_venvs(work: Path) -> dict[str, Path]:
    """Two venvs of the base interpreter that differ only in gcpatch being installed.

    Both see the current environment's packages through a path line (`00-bench-env.pth`) and
    carry copies of its other .pth files (what its start-up runs besides gcpatch's); `with`
    also gets gcpatch's installed files (package, start-up module, gcpatch.pth, dist-info) in
    its own site-packages, as `pip install gcpatch` would put them. A path line adds a directory
    without running the .pth files in it, so `without` never runs gcpatch.pth.
    """
    site_dir, tops = gcpatch_files()
    env_dirs = []
    for key in ("purelib", "platlib"):
        path = str(Path(sysconfig.get_paths()[key]).resolve())
        if path not in env_dirs:
            env_dirs.append(path)
    other_pth = [p for d in env_dirs for p in sorted(Path(d).glob("*.pth")) if p.name not in tops]
    base = getattr(sys, "_base_executable", sys.executable)
    out = {}
    for name in ("without", "with"):
        py, target = _venv(base, work / f"venv-{name}")
        (target / "00-bench-env.pth").write_text("".join(d + "\n" for d in env_dirs))
        for pth in other_pth:
            (target / pth.name).write_text(_absolute_path_lines(pth))
        if name == "with":
            for top in tops:
                src = site_dir / top
                if src.is_dir():
                    shutil.copytree(src, target / top)
                elif src.exists():
                    shutil.copy2(src, target / top)
        out[name] = py
    return out


def _venv(base: str, root: Path) -> tuple[Path, Path]:
    """A fresh venv at `root` without pip: its interpreter and its site-packages."""
    if root.exists():
        shutil.rmtree(root)
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True)
    py = root / "bin" / "python"
    if not py.exists():
        py = root / "Scripts" / "python.exe"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return py, Path(purelib)


def _absolute_path_lines(pth: Path) -> str:
    """A .pth file's text with each path line made absolute, so that it stays valid elsewhere."""
    lines = []
    for line in pth.read_text().splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "import ", "import\t")):
            line = str((pth.parent / stripped).resolve())
        lines.append(line)
    return "\n".join(lines) + "\n"


def pth_line_cost_us() -> float:
    """What running gcpatch.pth's line costs when GCPATCH is unset, in microseconds (in-process)."""
    site_dir, _ = gcpatch_files()
    line = (site_dir / "gcpatch.pth").read_text().strip()
    code = compile(line, "gcpatch.pth", "exec")
    saved = os.environ.pop("GCPATCH", None)
    try:
        n = 20000
        best = min(timeit.repeat(lambda: exec(code, {}), number=n, repeat=5))
    finally:
        if saved is not None:
            os.environ["GCPATCH"] = saved
    return best / n * 1e6


def parse_importtime(stderr: str) -> dict:
    """From `-X importtime` output: the time of the imports made by gcpatch's modules (the
    outermost entries named *gcpatch*, their nested imports included), every module imported
    under them, and the heaviest non-gcpatch ones among those."""
    entries = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        _, cumulative, name = line[len("import time:") :].split("|")
        if not cumulative.strip().isdigit():
            continue  # the header
        level = (len(name) - len(name.lstrip()) - 1) // 2
        entries.append((level, name.strip(), int(cumulative)))
    # importtime prints a module after everything it imported: walk backwards to find parents.
    stack: list[tuple[int, bool, str]] = []  # (level, is or is under a gcpatch module, name)
    total, modules, heavy = 0, [], []
    for level, name, cumulative in reversed(entries):
        while stack and stack[-1][0] >= level:
            stack.pop()
        parent = stack[-1] if stack else None
        under = parent is not None and parent[1]
        mine = "gcpatch" in name
        if mine and not under:
            total += cumulative
        if mine or under:
            modules.append(name)
        if not mine and parent is not None and "gcpatch" in parent[2]:
            heavy.append((name, cumulative / 1000))  # imported directly by a gcpatch module
        stack.append((level, mine or under, name))
    heavy.sort(key=lambda x: -x[1])
    return {"ms": total / 1000, "modules": list(reversed(modules)), "heavy": heavy[:6]}


def pth_file_cost_us() -> float:
    """What site.py does for gcpatch.pth at every start-up (open, read, exec the line) with
    GCPATCH unset, in microseconds: `site.addpackage` on the installed file, in-process."""
    import site

    site_dir, _ = gcpatch_files()
    saved = os.environ.pop("GCPATCH", None)
    try:
        n = 2000
        best = min(
            timeit.repeat(
                lambda: site.addpackage(str(site_dir), "gcpatch.pth", set()), number=n, repeat=5
            )
        )
    finally:
        if saved is not None:
            os.environ["GCPATCH"] = saved
    return best / n * 1e6


def gcpatch_importtime_ms(py: Path, runs: int, code: str = "pass") -> dict:
    """With GCPATCH=1: what gcpatch's own imports take (-X importtime), median over runs."""
    parsed = []
    for _ in range(runs):
        proc = subprocess.run(
            [str(py), "-X", "importtime", "-c", code],
            env=child_env(GCPATCH="1"),
            capture_output=True,
            text=True,
            check=True,
        )
        parsed.append(parse_importtime(proc.stderr))
    totals = [p["ms"] for p in parsed]
    middle = sorted(parsed, key=lambda p: p["ms"])[len(parsed) // 2]
    return {
        "min_ms": min(totals),
        "median_ms": med(totals),
        "modules": middle["modules"],
        "heavy": middle["heavy"],
    }


def bench_startup(cfg: dict, work: Path) -> dict:
    log("start-up: building the two venvs")
    venvs = make_venvs(work)
    cmd_without, cmd_with = (
        [str(venvs["without"]), "-c", "pass"],
        [str(venvs["with"]), "-c", "pass"],
    )
    check = subprocess.run(
        [
            str(venvs["with"]),
            "-c",
            "import sys; print(any(repr(f) == '<gcpatch framework watcher>' for f in sys.meta_path))",
        ],
        env=child_env(GCPATCH="1"),
        capture_output=True,
        text=True,
    )
    if check.stdout.strip() != "True":
        raise RuntimeError(
            f"the `with` venv does not activate gcpatch at start-up: {check.stdout} {check.stderr}"
        )
    log(f"start-up: {cfg['startup_runs']} interleaved runs of each variant")
    times = interleave(
        {
            "without": (cmd_without, child_env()),
            "unset": (cmd_with, child_env()),
            "on": (cmd_with, child_env(GCPATCH="1")),
        },
        cfg["startup_runs"],
        warm=cfg["warm"],
    )
    log(f"import transformers: {cfg['import_runs']} interleaved runs of each variant")
    imp = interleave(
        {
            "without": ([str(venvs["without"]), "-c", "import transformers"], child_env()),
            "unset": ([str(venvs["with"]), "-c", "import transformers"], child_env()),
            "on": ([str(venvs["with"]), "-c", "import transformers"], child_env(GCPATCH="1")),
        },
        cfg["import_runs"],
        warm=cfg["warm"],
    )
    return {
        "startup_s": times,
        "import_s": imp,
        "pth_line_us": pth_line_cost_us(),
        "pth_file_us": pth_file_cost_us(),
        "importtime": gcpatch_importtime_ms(venvs["with"], cfg["importtime_runs"]),
        "importtime_transformers": gcpatch_importtime_ms(
            venvs["with"], max(1, cfg["import_runs"] // 2), "import transformers"
        ),
        "venvs": {
            k: os.path.relpath(v, HERE.parent) for k, v in venvs.items()
        },  # no machine path in results
    }


# ---------------------------------------------------------------------------------------------
# 3. the enable call, and 4./5. the training set-ups
# ---------------------------------------------------------------------------------------------


def bench_enable(cfg: dict) -> dict:
    args = {
        "tiny": TINY,
        "small": cfg["model"],
        "models": cfg["enable_models"],
        "small_models": cfg["small_models"],
    }
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for i in range(cfg["enable_procs"]):
        for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
            log(f"enable call: process {i + 1}/{cfg['enable_procs']}, gcpatch {name}")
            result = run_worker(
                "enable", args, child_env(**({"GCPATCH": "1"} if name == "on" else {}))
            )
            if result["gcpatch_active"] != (name == "on"):
                raise RuntimeError(
                    f"gcpatch active={result['gcpatch_active']} in the {name} process"
                )
            runs[name].append(result)
    return runs


def bench_cases(cfg: dict) -> dict:
    base = {
        "model": cfg["model"],
        "batch": cfg["batch"],
        "seq": cfg["seq"],
        "warmup": cfg["warmup"],
        "steps": cfg["steps"],
        "threads": cfg["threads"],
    }
    cases, meta = [], {}
    per = cfg["setups_per_process"]
    for i in range(0, len(SETUP_ORDER), per):
        names = SETUP_ORDER[i : i + per]
        log(f"set-up {', '.join(names)}: saved bytes, gradients, {cfg['steps']} interleaved steps")
        result = run_worker("case", {**base, "setups": names}, child_env())
        cases += result.pop("cases")
        meta = result
    return {"cases": cases, **meta}


# ---------------------------------------------------------------------------------------------
