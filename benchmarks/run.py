"""gcpatch's benchmark: what gcpatch costs, and what checkpointing saves with it.

    python benchmarks/run.py            # the full run: writes benchmarks/RESULTS.md, results.png, results.json
    python benchmarks/run.py --smoke --out /tmp/x   # the smallest setting, for the smoke test

Run it with an interpreter whose environment has gcpatch and transformers installed (and
matplotlib for the plot; without it the table is still written). Nothing is downloaded: every
model is random-initialised from a config, and HF_HUB_OFFLINE=1 is set for every child.

Every comparison runs its variants interleaved (round by round, in rotating order) in the same
run, and is reported as a ratio: absolute times on a shared machine drift from run to run.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
import timeit
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_worker.py"
SETUP_ORDER = ["full", "full_reentrant", "lora", "lora_embeds", "eval"]

FULL = dict(
    startup_runs=200, importtime_runs=30, import_runs=8, warm=True, enable_procs=3, enable_models=20, small_models=3,
    model=dict(num_hidden_layers=8, hidden_size=256, intermediate_size=688, num_attention_heads=4,
               num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024),
    batch=1, seq=512, warmup=1, steps=8, threads=1, setups_per_process=1,
)
SMOKE = dict(
    startup_runs=5, importtime_runs=2, import_runs=1, warm=False, enable_procs=1, enable_models=2, small_models=1,
    model=dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=4, vocab_size=512, max_position_embeddings=128),
    batch=1, seq=32, warmup=0, steps=1, threads=1, setups_per_process=len(SETUP_ORDER),
)
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=1000, max_position_embeddings=128)

TARGETS = {
    "startup_off": 1.01, "startup_on": 1.05, "enable_ms": 1.0, "step": 1.01, "bytes": 1.00, "eval": 1.10,
}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def log(text: str) -> None:
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {text}\n")
    sys.stderr.flush()


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every child: no GCPATCH* variable of the caller's, offline, quiet."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCPATCH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def run_worker(task: str, args: dict, env: dict[str, str], timeout: float = 900) -> dict:
    proc = subprocess.run([sys.executable, str(WORKER), task, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=HERE)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"worker {task} failed (rc {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


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


def interleave(variants: dict[str, tuple[list[str], dict[str, str]]], runs: int,
               warm: bool = True) -> dict[str, list[float]]:
    """Wall time of each variant's command, `runs` rounds, the order rotating every round."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names if warm else []:  # one untimed run each: page cache and .pyc files warm for all
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
        root = work / f"venv-{name}"
        if root.exists():
            shutil.rmtree(root)
        subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True)
        py = root / "bin" / "python"
        if not py.exists():
            py = root / "Scripts" / "python.exe"
        purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        target = Path(purelib)
        (target / "00-bench-env.pth").write_text("".join(d + "\n" for d in env_dirs))
        for pth in other_pth:
            lines = []
            for line in pth.read_text().splitlines():
                stripped = line.strip()
                if stripped and not stripped.startswith(("#", "import ", "import\t")):
                    line = str((pth.parent / stripped).resolve())  # a relative path line stays valid
                lines.append(line)
            (target / pth.name).write_text("\n".join(lines) + "\n")
        if name == "with":
            for top in tops:
                src = site_dir / top
                if src.is_dir():
                    shutil.copytree(src, target / top)
                elif src.exists():
                    shutil.copy2(src, target / top)
        out[name] = py
    return out


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
        _, cumulative, name = line[len("import time:"):].split("|")
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
        best = min(timeit.repeat(lambda: site.addpackage(str(site_dir), "gcpatch.pth", set()), number=n, repeat=5))
    finally:
        if saved is not None:
            os.environ["GCPATCH"] = saved
    return best / n * 1e6


def gcpatch_importtime_ms(py: Path, runs: int, code: str = "pass") -> dict:
    """With GCPATCH=1: what gcpatch's own imports take (-X importtime), median over runs."""
    parsed = []
    for _ in range(runs):
        proc = subprocess.run([str(py), "-X", "importtime", "-c", code], env=child_env(GCPATCH="1"),
                              capture_output=True, text=True, check=True)
        parsed.append(parse_importtime(proc.stderr))
    totals = [p["ms"] for p in parsed]
    middle = sorted(parsed, key=lambda p: p["ms"])[len(parsed) // 2]
    return {"min_ms": min(totals), "median_ms": med(totals), "modules": middle["modules"], "heavy": middle["heavy"]}


def bench_startup(cfg: dict, work: Path) -> dict:
    log("start-up: building the two venvs")
    venvs = make_venvs(work)
    cmd_without, cmd_with = [str(venvs["without"]), "-c", "pass"], [str(venvs["with"]), "-c", "pass"]
    check = subprocess.run([str(venvs["with"]), "-c",
                            "import sys; print(any(repr(f) == '<gcpatch framework watcher>' for f in sys.meta_path))"],
                           env=child_env(GCPATCH="1"), capture_output=True, text=True)
    if check.stdout.strip() != "True":
        raise RuntimeError(f"the `with` venv does not activate gcpatch at start-up: {check.stdout} {check.stderr}")
    log(f"start-up: {cfg['startup_runs']} interleaved runs of each variant")
    times = interleave({
        "without": (cmd_without, child_env()),
        "unset": (cmd_with, child_env()),
        "on": (cmd_with, child_env(GCPATCH="1")),
    }, cfg["startup_runs"], warm=cfg["warm"])
    log(f"import transformers: {cfg['import_runs']} interleaved runs of each variant")
    imp = interleave({
        "without": ([str(venvs["without"]), "-c", "import transformers"], child_env()),
        "unset": ([str(venvs["with"]), "-c", "import transformers"], child_env()),
        "on": ([str(venvs["with"]), "-c", "import transformers"], child_env(GCPATCH="1")),
    }, cfg["import_runs"], warm=cfg["warm"])
    return {
        "startup_s": times, "import_s": imp,
        "pth_line_us": pth_line_cost_us(),
        "pth_file_us": pth_file_cost_us(),
        "importtime": gcpatch_importtime_ms(venvs["with"], cfg["importtime_runs"]),
        "importtime_transformers": gcpatch_importtime_ms(venvs["with"], max(1, cfg["import_runs"] // 2),
                                                         "import transformers"),
        "venvs": {k: str(v) for k, v in venvs.items()},
    }


# ---------------------------------------------------------------------------------------------
# 3. the enable call, and 4./5. the training set-ups
# ---------------------------------------------------------------------------------------------

def bench_enable(cfg: dict) -> dict:
    args = {"tiny": TINY, "small": cfg["model"], "models": cfg["enable_models"], "small_models": cfg["small_models"]}
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for i in range(cfg["enable_procs"]):
        for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
            log(f"enable call: process {i + 1}/{cfg['enable_procs']}, gcpatch {name}")
            result = run_worker("enable", args, child_env(**({"GCPATCH": "1"} if name == "on" else {})))
            if result["gcpatch_active"] != (name == "on"):
                raise RuntimeError(f"gcpatch active={result['gcpatch_active']} in the {name} process")
            runs[name].append(result)
    return runs


def bench_cases(cfg: dict) -> dict:
    base = {"model": cfg["model"], "batch": cfg["batch"], "seq": cfg["seq"], "warmup": cfg["warmup"],
            "steps": cfg["steps"], "threads": cfg["threads"]}
    cases, meta = [], {}
    per = cfg["setups_per_process"]
    for i in range(0, len(SETUP_ORDER), per):
        names = SETUP_ORDER[i:i + per]
        log(f"set-up {', '.join(names)}: saved bytes, gradients, {cfg['steps']} interleaved steps")
        result = run_worker("case", {**base, "setups": names}, child_env())
        cases += result.pop("cases")
        meta = result
    return {"cases": cases, **meta}


# ---------------------------------------------------------------------------------------------
# summarising
# ---------------------------------------------------------------------------------------------

def _median_ci(values: list[float]) -> list[float]:
    """A distribution-free 95% interval of a median (binomial order statistics)."""
    ranked = sorted(values)
    n = len(ranked)
    if not n:
        return [float("nan"), float("nan")]
    half = 1.96 * n ** 0.5 / 2
    return [ranked[max(0, int(n / 2 - half))], ranked[min(n - 1, int(n / 2 + half))]]


def summarise(raw: dict) -> dict:
    s: dict = {}
    st = raw["startup"]["startup_s"]
    s["startup"] = {k: {"min_ms": min(v) * 1000, "median_ms": med(v) * 1000} for k, v in st.items()}
    s["startup_off"] = {"median": med(st["unset"]) / med(st["without"]), "min": min(st["unset"]) / min(st["without"]),
                        "paired": paired_ratio(st["unset"], st["without"])}
    s["startup_on"] = {"median": med(st["on"]) / med(st["unset"]), "min": min(st["on"]) / min(st["unset"]),
                       "paired": paired_ratio(st["on"], st["unset"])}
    im = raw["startup"]["import_s"]
    s["import"] = {k: {"min_ms": min(v) * 1000, "median_ms": med(v) * 1000} for k, v in im.items()}
    s["import_off"] = {"median": med(im["unset"]) / med(im["without"]), "min": min(im["unset"]) / min(im["without"])}
    s["import_on"] = {"median": med(im["on"]) / med(im["unset"]), "min": min(im["on"]) / min(im["unset"]),
                      "added_ms": (med(im["on"]) - med(im["unset"])) * 1000}

    en = raw["enable"]
    def pool(name: str, key: str) -> list[float]:
        values: list[float] = []
        for r in en[name]:
            values += r[key] if isinstance(r[key], list) else [r[key]]
        return values
    for name in ("off", "on"):
        for r in en[name]:
            r["import_total_ms"] = r["import_transformers_ms"] + r["import_modeling_ms"]
    s["enable"] = {}
    for key in ("import_total_ms", "first_enable_ms", "tiny_enable_ms", "small_enable_ms", "again_enable_ms",
                "import_transformers_ms", "import_modeling_ms"):
        off, on = pool("off", key), pool("on", key)
        s["enable"][key] = {"off": med(off), "on": med(on), "added": med(on) - med(off), "n": len(on)}

    cases = raw["cases"]["cases"]
    s["cases"] = []
    pooled: list[float] = []
    worst_bytes = 0.0
    for c in cases:
        v = c["variants"]
        hand = {k: x for k, x in v.items() if k.startswith("hand-")}
        correct = {k: x for k, x in hand.items() if x["correct"]}
        best = min(correct, key=lambda k: (correct[k]["packed"], k)) if correct else None
        row = {"setup": c["setup"], "label": c["label"], "best": best, "same": c["same_choice"],
               "other": c["other_choice"], "floor": v["none"]["floor_packed"],
               "gcpatch_applied": v["gcpatch"].get("applied", {}), "rules": v["gcpatch"].get("rules", [])}
        if best:
            row["bytes_ratio"] = v["gcpatch"]["packed"] / v[best]["packed"]
            worst_bytes = max(worst_bytes, row["bytes_ratio"])
        row["floor_ratio"] = v["gcpatch"]["packed"] / v["none"]["floor_packed"]
        steps = c["step_s"]
        row["step_med"] = {k: med(x) for k, x in steps.items()}
        row["step_ratio"] = paired_ratio(steps["gcpatch"], steps[c["same_choice"]])
        row["step_ratio_median"] = med(steps["gcpatch"]) / med(steps[c["same_choice"]])
        pooled += [a / b for a, b in zip(steps["gcpatch"], steps[c["same_choice"]])]
        if c["other_choice"]:
            r_, nr = ("hand-R", "hand-NR")
            row["reentrant_ratio"] = paired_ratio(steps[r_], steps[nr])
        if "none" in steps:
            row["ckpt_overhead"] = paired_ratio(steps[c["same_choice"]], steps["none"])
        if c["setup"] == "eval":
            row["eval_ratio"] = v["gcpatch"]["packed"] / v[c["same_choice"]]["packed"]
            row["eval_plain_ratio"] = v["plain"]["packed"] / v[c["same_choice"]]["packed"]
            s["eval"] = row["eval_ratio"]
        row["hooks_added"] = v["gcpatch"]["hooks"] - v[c["same_choice"]]["hooks"]
        s["cases"].append(row)
    rr_pairs = [a / b for c in cases if c["other_choice"]
                for a, b in zip(c["step_s"]["hand-R"], c["step_s"]["hand-NR"])]
    s["reentrant_pooled"] = med(rr_pairs) if rr_pairs else None
    s["reentrant_pooled_ci"] = _median_ci(rr_pairs)
    s["reentrant_pooled_n"] = len(rr_pairs)
    s["step_pooled"] = med(pooled)
    ranked = sorted(pooled)
    n = len(ranked)
    half = 1.96 * n ** 0.5 / 2  # distribution-free 95% interval of a median (binomial order statistics)
    lo, hi = max(0, int(n / 2 - half)), min(n - 1, int(n / 2 + half))
    s["step_pooled_ci"] = [ranked[lo], ranked[hi]] if n else [float("nan")] * 2
    s["step_pooled_n"] = len(pooled)
    s["bytes_worst"] = worst_bytes
    return s


# ---------------------------------------------------------------------------------------------
# writing: RESULTS.md and the plot
# ---------------------------------------------------------------------------------------------

def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def verdict(value: float, target: float) -> str:
    return "met" if value <= target + 1e-12 else "**missed**"


VARIANT_TEXT = {
    "none": "no checkpointing",
    "plain": "plain set-up (transformers, the user's ask)",
    "hand-R": "by hand: use_reentrant=True",
    "hand-NR": "by hand: use_reentrant=False",
    "hand-train-R": "by hand: model.train() + use_reentrant=True",
    "hand-train-NR": "by hand: model.train() + use_reentrant=False",
    "gcpatch": "gcpatch (the user's ask)",
}


def write_results(raw: dict, s: dict, out: Path, smoke: bool, plot_note: str) -> Path:
    env = raw["env"]
    e = s["enable"]
    t = TARGETS
    eval_row = next((r for r in s["cases"] if r["setup"] == "eval"), None)
    lines: list[str] = []
    add = lines.append
    add("# gcpatch benchmarks")
    add("")
    add("Reproduce with one command, from the repository root, with an interpreter whose environment has gcpatch, "
        "transformers and (for the plot) matplotlib installed:")
    add("")
    add("```")
    add("python benchmarks/run.py")
    add("```")
    add("")
    add("It writes this file, `benchmarks/results.png` and `benchmarks/results.json` (raw figures), builds two "
        "scratch venvs under `benchmarks/.work/` (git-ignored), downloads nothing, and takes about 7 minutes "
        "on this 2-core machine shared with other jobs. `python benchmarks/run.py --smoke --out DIR` is the smallest setting "
        "(`tests/test_benchmark_smoke.py` runs it).")
    add("")
    if smoke:
        add("> **Smoke run**: the smallest setting, figures are meaningless.")
        add("")
    add(f"Measured {env['date']} on {env['machine']}: Python {env['python']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, gcpatch {env['gcpatch']} (repository at {env.get('commit', 'unknown')}), {env['cpus']} CPUs "
        f"(training steps on {raw['cases'].get('threads')} torch thread(s): on a shared 2-core machine two OpenMP "
        f"threads stall each other whenever another job takes a core, which swamps the ratios), no GPU. Total run time {env['run_s']:.0f} s.")
    add("")
    add("All comparisons are ratios of variants run interleaved in the same run (round by round, in rotating "
        "order): absolute times on this shared machine drift from run to run, ratios much less.")
    add("")

    add("## Targets")
    add("")
    add("| what | measured | target | |")
    add("| --- | --- | --- | --- |")
    so, sn = s["startup_off"], s["startup_on"]
    add(f"| start-up, gcpatch installed and GCPATCH unset / venv without gcpatch (median of {len(raw['startup']['startup_s']['unset'])} runs) "
        f"| {so['median']:.3f}x (min {so['min']:.3f}x) | <= {t['startup_off']:.2f}x | {verdict(so['median'], t['startup_off'])} |")
    add(f"| start-up, GCPATCH=1 / unset, no framework imported (median) "
        f"| {sn['median']:.3f}x (min {sn['min']:.3f}x) | <= {t['startup_on']:.2f}x | {verdict(sn['median'], t['startup_on'])} |")
    io = s["import_on"]
    add(f"| `import transformers`, GCPATCH=1 / unset (median) | {io['median']:.3f}x (+{io['added_ms']:.1f} ms) | "
        f"(no target) | |")
    add(f"| enable call on a tiny model, added by gcpatch: first call in a process "
        f"| +{e['first_enable_ms']['added']:.2f} ms | <= +{t['enable_ms']:.0f} ms | {verdict(e['first_enable_ms']['added'], t['enable_ms'])} |")
    add(f"| enable call on a tiny model, added by gcpatch: each later model (median) "
        f"| +{e['tiny_enable_ms']['added']:.2f} ms | <= +{t['enable_ms']:.0f} ms | {verdict(e['tiny_enable_ms']['added'], t['enable_ms'])} |")
    add(f"| training step, gcpatch / the same use_reentrant choice by hand (median of {s['step_pooled_n']} "
        f"interleaved pairs over all set-ups) | {s['step_pooled']:.3f}x (95% CI {s['step_pooled_ci'][0]:.3f}-{s['step_pooled_ci'][1]:.3f}) | <= {t['step']:.2f}x | {verdict(s['step_pooled'], t['step'])} |")
    add(f"| saved activation bytes, gcpatch / best correct hand choice (worst set-up) | {s['bytes_worst']:.3f}x | "
        f"<= {t['bytes']:.2f}x | {verdict(s['bytes_worst'], t['bytes'])} |")
    if eval_row:
        add(f"| saved activation bytes, model left in eval mode / train mode, with gcpatch | {eval_row['eval_ratio']:.3f}x "
            f"(without gcpatch: {eval_row['eval_plain_ratio']:.2f}x) | <= {t['eval']:.1f}x | {verdict(eval_row['eval_ratio'], t['eval'])} |")
    add("")
    missed = explain_misses(raw, s)
    add("### Targets missed, other costs found, why, and what would close them")
    add("")
    add("\n\n".join(missed) if missed else "None in this run.")
    add("")

    add("## 1. Interpreter start-up (`python -c pass`)")
    add("")
    add("| variant | min (ms) | median (ms) |")
    add("| --- | --- | --- |")
    names = {"without": "venv without gcpatch", "unset": "gcpatch installed, GCPATCH unset",
             "on": "gcpatch installed, GCPATCH=1"}
    for k, label in names.items():
        add(f"| {label} | {s['startup'][k]['min_ms']:.2f} | {s['startup'][k]['median_ms']:.2f} |")
    it = raw["startup"]["importtime"]
    add("")
    own = [m for m in it["modules"] if "gcpatch" in m]
    add(f"Direct measurements: with GCPATCH unset, the `gcpatch.pth` line costs **{raw['startup']['pth_line_us']:.2f} µs** "
        f"(timeit, in-process; it imports nothing) and all that site.py does for the file (open, read, run: "
        f"`site.addpackage`) **{raw['startup'].get('pth_file_us', float('nan')):.1f} µs** per start-up. With GCPATCH=1, "
        f"`-X importtime` (which inflates times) attributes **{it['median_ms']:.2f} ms** (median of "
        f"{raw['config']['importtime_runs']}) to gcpatch's start-up imports: {', '.join(own)}, and the modules "
        f"they import that Python had not loaded yet: "
        + ", ".join(f"{n} {ms:.2f} ms" for n, ms in it["heavy"]) + ".")
    add("")
    add("Fair comparison: both venvs are made by `python -m venv` from the same base interpreter and see the "
        "same packages (the benchmarking environment's site-packages, through a path line, which adds a "
        "directory without running its .pth files); both carry copies of that environment's other .pth files. "
        "The `with` venv also has gcpatch's installed files (package, `_gcpatch_startup.py`, `gcpatch.pth`, "
        "dist-info) in its own site-packages. So the only difference is gcpatch being installed.")
    add("")

    add("## 2. `import transformers`")
    add("")
    add("| variant | min (ms) | median (ms) |")
    add("| --- | --- | --- |")
    for k, label in names.items():
        add(f"| {label} | {s['import'][k]['min_ms']:.1f} | {s['import'][k]['median_ms']:.1f} |")
    add("")
    itf = raw["startup"]["importtime_transformers"]
    add(f"Installed and unset / without: {s['import_off']['median']:.3f}x (median). GCPATCH=1 / unset: "
        f"{io['median']:.3f}x, +{io['added_ms']:.1f} ms: the watcher starts gcpatch's engine when transformers "
        "is first imported (entry points, the plugin module, post-import hooks). `-X importtime` attributes "
        f"{itf['median_ms']:.0f} ms to gcpatch's imports there; the heaviest modules gcpatch imports itself: "
        + ", ".join(f"`{n}` {ms:.1f} ms" for n, ms in itf["heavy"]) + ". "
        f"Measured inside the enable-call processes: `import transformers` "
        f"{e['import_transformers_ms']['off']:.0f} -> {e['import_transformers_ms']['on']:.0f} ms, and "
        f"`from transformers import LlamaForCausalLM` (torch, modeling_utils, the patches installed) "
        f"{e['import_modeling_ms']['off']:.0f} -> {e['import_modeling_ms']['on']:.0f} ms; both together "
        f"{e['import_total_ms']['off']:.0f} -> {e['import_total_ms']['on']:.0f} ms "
        f"({e['import_total_ms']['added']:+.0f} ms; medians of {e['import_total_ms']['n']} processes each, so "
        "noisy at this scale).")
    add("")

    add("## 3. The enable call")
    add("")
    add("`activation_checkpointing_enable()` (transformers 5.x; `gradient_checkpointing_enable()` on 4.x), asking "
        "nothing, in processes with GCPATCH unset and GCPATCH=1, interleaved.")
    add("")
    add("| call | without gcpatch (ms) | with gcpatch (ms) | added (ms) | n |")
    add("| --- | --- | --- | --- | --- |")
    rows = [("first enable in the process (tiny model)", "first_enable_ms"),
            ("each further tiny model's first enable (median)", "tiny_enable_ms"),
            ("8-layer model of section 4 (median)", "small_enable_ms"),
            ("the same tiny model enabled again (a Trainer re-enable; median)", "again_enable_ms")]
    for label, key in rows:
        x = e[key]
        add(f"| {label} | {x['off']:.3f} | {x['on']:.3f} | {x['added']:+.3f} | {x['n']} |")
    add("")
    add(f"Tiny model: LlamaConfig({', '.join(f'{k}={v}' for k, v in TINY.items())}). gcpatch's added time "
        "includes its one INFO line on stderr per decision.")
    add("")

    m = raw["config"]["model"]
    add("## 4. Training step time")
    add("")
    add(f"LlamaForCausalLM, random init: {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, intermediate "
        f"{m['intermediate_size']}, {m['num_attention_heads']} heads, vocab {m['vocab_size']} "
        f"({raw['cases']['params'] / 1e6:.1f} M parameters, attention `{raw['cases']['attn']}`), batch "
        f"{raw['config']['batch']} x seq {raw['config']['seq']}, fp32 on CPU. One step = forward with labels, "
        f"backward, AdamW. Per set-up the variants run {raw['config']['steps']} timed rounds (after "
        f"{raw['config']['warmup']} warm-up) interleaved in one process; ratios are medians of per-round ratios.")
    add("")
    add("| set-up | gcpatch applied | same choice by hand | gcpatch / same (s/step) | ratio | hooks added | reentrant / non-reentrant |")
    add("| --- | --- | --- | --- | --- | --- | --- |")
    for r in s["cases"]:
        applied = ", ".join(f"{k}={v}" for k, v in r["gcpatch_applied"].items())
        rr = f"{r['reentrant_ratio']:.3f}x" if "reentrant_ratio" in r else "n/a (reentrant is wrong here)" \
            if r["setup"] == "lora_embeds" else "n/a"
        add(f"| {r['label']} | {applied} ({'+'.join(r['rules'])}) | {VARIANT_TEXT[r['same']]} | "
            f"{r['step_med']['gcpatch']:.3f} / {r['step_med'][r['same']]:.3f} | {r['step_ratio']:.3f}x | "
            f"{r['hooks_added']} | {rr} |")
    full = next((r for r in s["cases"] if r["setup"] == "full"), None)
    add("")
    if full and "ckpt_overhead" in full:
        add(f"Checkpointing itself (full fine-tune, non-reentrant / no checkpointing): "
            f"{full['ckpt_overhead']:.3f}x step time.")
        add("")
    if eval_row:
        add(f"Eval-mode set-up: without gcpatch the user's step takes {eval_row['step_med']['plain']:.3f} s, "
            "because checkpointing silently does nothing (and saves no memory, section 5).")
        add("")
    rr_rows = [r for r in s["cases"] if "reentrant_ratio" in r]
    if rr_rows and s.get("reentrant_pooled"):
        text = ", ".join(f"{r['setup']} {r['reentrant_ratio']:.3f}x" for r in rr_rows)
        lo, hi = s["reentrant_pooled_ci"]
        pooled = s["reentrant_pooled"]
        if lo <= 1.0 <= hi:
            verdict_text = "Not measurably, here: the interval contains 1.0 (on CPU, this model, this noise)."
        elif hi < 1.0:
            verdict_text = f"Yes, here: reentrant is about {(1 - pooled) * 100:.0f}% faster."
        else:
            verdict_text = f"No, here: reentrant is about {(pooled - 1) * 100:.0f}% slower."
        add(f"**Is reentrant faster (Axolotl's claim)?** Reentrant / non-reentrant step time, both by hand, where "
            f"both are correct: per set-up {text}; all {s['reentrant_pooled_n']} interleaved pairs pooled "
            f"{pooled:.3f}x (95% CI {lo:.3f}-{hi:.3f}). {verdict_text}")
        add("")
    add("\"hooks added\" counts the module hooks and wrapped checkpoint functions a step runs on gcpatch's model "
        "beyond the hand-made one (its R2 input-grads hooks when reentrant is kept, its R5 mode-preserving "
        "wrappers); where it is 0 a step runs exactly the same code, and the ratio is noise.")
    add("")

    add("## 5. Saved activation bytes")
    add("")
    add("Bytes packed by `torch.autograd.graph.saved_tensors_hooks` during the forward (numel x element_size of "
        "every saved tensor that is not a parameter or buffer; MiB). \"distinct\" counts each storage once "
        "(a tensor saved by several ops). The floor is what checkpointing every layer must keep: each "
        "layer's input plus everything saved outside the layers (measured on the model without "
        "checkpointing). Correct = every trainable parameter's gradient matches the model without "
        "checkpointing.")
    add("")
    add("| set-up | variant | saved MiB | distinct MiB | correct | vs floor |")
    add("| --- | --- | --- | --- | --- | --- |")
    for c, r in zip(raw["cases"]["cases"], s["cases"]):
        v = c["variants"]
        order = [k for k in ("none", "plain", "hand-R", "hand-NR", "hand-train-R", "hand-train-NR", "gcpatch") if k in v]
        for k in order:
            x = v[k]
            if x["correct"]:
                ok = "yes"
            elif x["error"]:
                ok = f"**no**: backward fails ({x['error'][:60]})"
            else:
                ok = f"**no**: {x['wrong_grads']} of {x['trainable']} gradients wrong"
            label = VARIANT_TEXT[k] + (" **(best correct hand choice)**" if k == r["best"] else "")
            add(f"| {c['label'] if k == order[0] else ''} | {label} | {mib(x['packed'])} | {mib(x['unique'])} | {ok} | "
                f"{x['packed'] / r['floor']:.2f}x |")
        add(f"| | theoretical floor | {mib(r['floor'])} | | | 1.00x |")
    add("")
    add("| set-up | gcpatch / best correct hand choice | gcpatch / floor |")
    add("| --- | --- | --- |")
    for r in s["cases"]:
        br = f"{r['bytes_ratio']:.3f}x ({r['best']})" if "bytes_ratio" in r else "n/a"
        add(f"| {r['label']} | {br} | {r['floor_ratio']:.3f}x |")
    add("")
    add("## Not measured")
    add("")
    add("GPU figures (peak CUDA memory and step time on a GPU) are not measured: no GPU was "
        "available to this run. The saved-bytes figures above do not depend on the device; the step-time "
        "ratios on a GPU may differ (kernel launch overhead weighs more there).")
    add("")
    add(f"Plot: `results.png` ({plot_note}).")
    add("")
    path = out / "RESULTS.md"
    path.write_text("\n".join(lines))
    return path


def explain_misses(raw: dict, s: dict) -> list[str]:
    """A paragraph for each missed target: the mechanism measured in this run, and the fix."""
    t, e = TARGETS, s["enable"]
    notes = []
    if s["startup_off"]["median"] > t["startup_off"]:
        notes.append(
            f"- **Start-up, off** ({s['startup_off']['median']:.3f}x; min {s['startup_off']['min']:.3f}x, median "
            f"of per-round ratios {s['startup_off']['paired']:.3f}x): everything gcpatch adds to a start-up when "
            f"GCPATCH is unset is site.py processing gcpatch.pth, measured directly at "
            f"{raw['startup'].get('pth_file_us', float('nan')):.1f} µs = "
            f"{raw['startup'].get('pth_file_us', float('nan')) / 1000 / s['startup']['without']['min_ms'] * 100:.2f}% "
            f"of the fastest {s['startup']['without']['min_ms']:.1f} ms start-up, so the rest of the measured "
            "difference is this machine's noise (other jobs share its 2 cores; the medians ran at about twice the "
            "minimum), which the wall clock of a ~10 ms process cannot resolve to 1% here. A quiet machine "
            "(or more runs) would close it; nothing left in gcpatch would.")
    if s["startup_on"]["median"] > t["startup_on"]:
        it = raw["startup"]["importtime"]
        notes.append(
            f"- **Start-up, GCPATCH=1** ({s['startup_on']['median']:.3f}x): the .pth line imports "
            f"{', '.join(m for m in it['modules'] if 'gcpatch' in m)} and, through them, modules a bare "
            "interpreter does not load: " + ", ".join(f"`{n}` ({ms:.2f} ms under -X importtime)" for n, ms in it["heavy"])
            + ". What would close it: the start-up line imports the `gcpatch` package only to install its "
            "framework watcher (gcpatch/activation.py); moving that watcher into `_gcpatch_startup` itself (no "
            "package import until a framework is first imported) would leave one small module on this path.")
    if e["first_enable_ms"]["added"] > t["enable_ms"]:
        versions = [r["versions_ms"] for r in raw["enable"]["on"] if r.get("versions_ms") is not None]
        notes.append(
            f"- **First enable call** (+{e['first_enable_ms']['added']:.2f} ms; each later model "
            f"+{e['tiny_enable_ms']['added']:.2f} ms): versions now come from the imported modules' "
            f"`__version__` ({med(versions):.2f} ms, median); what remains is first-time work in the process "
            "(the first log record and its handler, the first records and fact gathering, Python's first-call "
            "caches), not broken down further by this benchmark. What would close it: measure it with a "
            "profiler (py-spy) on the first call and defer what is not needed for the decision itself (e.g. "
            "writing the log line) to after the framework's enable returns.")
    elif e["tiny_enable_ms"]["added"] > t["enable_ms"]:
        notes.append(
            f"- **Enable call** (+{e['tiny_enable_ms']['added']:.2f} ms per model): gathering facts walks "
            "every parameter and module of the model (twice: in facts.gather and in apply); caching the layer "
            "list would close it.")
    if s["import_on"]["added_ms"] > 50:
        itf = raw["startup"]["importtime_transformers"]
        heavy = ", ".join(f"`{n}` {ms:.0f} ms" for n, ms in itf["heavy"][:3])
        notes.append(
            f"- **`import transformers` with GCPATCH=1** (no target; +{s['import_on']['added_ms']:.0f} ms, "
            f"{s['import_on']['median']:.2f}x): starting the engine loads the transformers plugin, which imports "
            "`gcpatch.pipeline` -> `gcpatch.apply`, and apply.py has `import torch` at module level; so "
            "`import transformers`, lazy by design, now imports torch at once (heaviest imports made by "
            f"gcpatch modules: {heavy}). Code that imports transformers but never torch (tokenizers, configs, "
            "CLIs) pays it; a training script imports torch anyway (see `from transformers import "
            f"LlamaForCausalLM` after it: {e['import_total_ms']['added']:+.0f} ms for both together, section 2). "
            "What would close it: "
            "import torch inside the functions of gcpatch.apply that use it (or import gcpatch.pipeline from "
            "the plugin's wrappers, on the first enable call).")
    if s["step_pooled"] > t["step"]:
        hooks = {r["setup"]: r["hooks_added"] for r in s["cases"]}
        zero = [k for k, v in hooks.items() if v == 0]
        notes.append(
            f"- **Step time** ({s['step_pooled']:.3f}x, 95% CI {s['step_pooled_ci'][0]:.3f}-{s['step_pooled_ci'][1]:.3f}; "
            f"single steps vary by tens of percent on this shared machine): in {', '.join(zero) or 'no set-up'} gcpatch's model runs "
            "exactly the code of the hand-made one (0 hooks added, the first-forward hook removed itself after "
            "the first step), so there the difference is noise of this shared machine; per set-up ratios are in "
            "section 4. More rounds, or a quiet machine, would narrow it; nothing per step is left in gcpatch "
            "to cut there. Where hooks are added (reentrant kept: R2's input-grads hooks; eval mode: R5's "
            "wrappers) each costs microseconds per step against a step of hundreds of milliseconds.")
    if s["bytes_worst"] > t["bytes"]:
        worst = max((r for r in s["cases"] if "bytes_ratio" in r), key=lambda r: r["bytes_ratio"])
        notes.append(f"- **Saved bytes** ({s['bytes_worst']:.3f}x in {worst['label']}): gcpatch saved more than "
                     f"the best correct hand choice ({worst['best']}); see section 5.")
    if s.get("eval", 0) > t["eval"]:
        notes.append(f"- **Eval mode** ({s['eval']:.3f}x): R5 did not make checkpointing take full effect; see "
                     "section 5.")
    return notes


def plot(raw: dict, s: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    cases = raw["cases"]["cases"]
    short = {"full": "full FT", "full_reentrant": "full FT\nasks reentrant", "lora": "LoRA-like\nasks reentrant",
             "lora_embeds": "LoRA-like\ninputs_embeds", "eval": "left in\neval mode"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    kinds = [("none", "no checkpointing", "#bbbbbb"), ("plain", "plain set-up", "#e07b39"),
             ("best", "best correct hand choice", "#4c72b0"), ("gcpatch", "gcpatch", "#55a868")]
    width = 0.2
    for i, (c, r) in enumerate(zip(cases, s["cases"])):
        for j, (kind, label, color) in enumerate(kinds):
            key = r["best"] if kind == "best" else kind
            if key is None:
                continue
            x = c["variants"][key]
            bar = ax1.bar(i + (j - 1.5) * width, x["packed"] / 2**20, width, color=color,
                          label=label if i == 0 else None, hatch=None if x["correct"] else "//",
                          edgecolor="black" if not x["correct"] else None)
            if not x["correct"]:
                ax1.annotate("wrong", (bar[0].get_x() + width / 2, x["packed"] / 2**20), ha="center",
                             va="bottom", fontsize=7, rotation=90)
        ax1.hlines(r["floor"] / 2**20, i - 2 * width, i + 2 * width, colors="black", linestyles="--",
                   label="floor" if i == 0 else None)
    ax1.set_xticks(range(len(cases)), [short.get(c["setup"], c["setup"]) for c in cases], fontsize=8)
    ax1.set_ylabel("saved activations (MiB)")
    ax1.set_title("Saved activation bytes per set-up (hatched: wrong gradients)")
    ax1.legend(fontsize=8)
    order = ["none", "plain", "hand-R", "hand-NR", "hand-train-NR", "hand-train-R", "gcpatch"]
    colors = {"none": "#bbbbbb", "plain": "#e07b39", "hand-R": "#8172b2", "hand-NR": "#4c72b0",
              "hand-train-NR": "#4c72b0", "hand-train-R": "#8172b2", "gcpatch": "#55a868"}
    seen = set()
    for i, c in enumerate(cases):
        keys = [k for k in order if k in c["step_s"]]
        for j, k in enumerate(keys):
            vals = c["step_s"][k]
            q = sorted(vals)
            lo, hi = q[len(q) // 4], q[(3 * len(q)) // 4]
            m = med(vals)
            label = VARIANT_TEXT[k].replace("by hand: ", "hand ") if k not in seen else None
            seen.add(k)
            ax2.bar(i + (j - (len(keys) - 1) / 2) * width, m, width, color=colors[k], label=label,
                    yerr=[[m - lo], [hi - m]], capsize=2)
    ax2.set_xticks(range(len(cases)), [short.get(c["setup"], c["setup"]) for c in cases], fontsize=8)
    ax2.set_ylabel("s / training step (median, IQR)")
    ax2.set_title("Training step time per set-up (interleaved)")
    ax2.legend(fontsize=7)
    fig.suptitle(f"gcpatch {raw['env']['gcpatch']}, transformers {raw['env']['transformers']}, "
                 f"torch {raw['env']['torch']}, CPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "memory and step time per set-up"


# ---------------------------------------------------------------------------------------------

def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gcpatch", "plugins", "_gcpatch_startup.py"],
                               cwd=HERE.parent, capture_output=True, text=True)
        return head.stdout.strip() + (" + uncommitted gcpatch changes" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the smallest setting (seconds; figures meaningless)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write RESULTS.md, results.png, results.json (default: benchmarks/; "
                             "--smoke requires it, so that the committed results are never overwritten)")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite RESULTS.md and results.png from an existing results.json in --out")
    opts = parser.parse_args(argv)
    if opts.render_only:
        out = (opts.out or HERE).resolve()
        raw = json.loads((out / "results.json").read_text())["raw"]
        s = summarise(raw)
        (out / "results.json").write_text(json.dumps({"raw": raw, "summary": s}, indent=1, default=str))
        plot_note = plot(raw, s, out / "results.png")
        write_results(raw, s, out, raw.get("smoke", False), plot_note)
        return 0
    if opts.smoke and opts.out is None:
        parser.error("--smoke needs --out DIR (the committed results are not overwritten by a smoke run)")
    out = (opts.out or HERE).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = (out / ".work") if opts.smoke else HERE / ".work"
    work.mkdir(parents=True, exist_ok=True)
    cfg = SMOKE if opts.smoke else FULL
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        gcpatch_version = metadata.version("gcpatch")
    except (ImportError, metadata.PackageNotFoundError) as exc:
        sys.stderr.write(f"run.py needs gcpatch, torch and transformers installed in this environment ({exc})\n")
        return 2
    if os.environ.get("GCPATCH") or "gcpatch" in sys.modules:
        log("note: this driver's own process ignores GCPATCH; every measurement runs in a fresh child")

    started = time.perf_counter()
    raw: dict = {"config": cfg, "smoke": opts.smoke}
    raw["startup"] = bench_startup(cfg, work)
    raw["enable"] = bench_enable(cfg)
    raw["cases"] = bench_cases(cfg)
    raw["env"] = {
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(), "torch": metadata.version("torch"),
        "transformers": metadata.version("transformers"), "gcpatch": gcpatch_version,
        "cpus": os.cpu_count(), "run_s": time.perf_counter() - started, "commit": _commit(),
    }
    s = summarise(raw)
    (out / "results.json").write_text(json.dumps({"raw": raw, "summary": s}, indent=1, default=str))
    plot_note = plot(raw, s, out / "results.png")
    path = write_results(raw, s, out, opts.smoke, plot_note)
    log(f"wrote {path}" + ("" if plot_note.startswith("skipped") else f" and {out / 'results.png'}")
        + (f" (plot {plot_note})" if plot_note.startswith("skipped") else ""))
    print(path.read_text().split("## 1.")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
