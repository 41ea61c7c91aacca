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
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from measure import FULL, HERE, SMOKE, bench_cases, bench_enable, bench_startup, log
from report import plot, summarise, write_results


def _commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "gcpatch", "plugins", "_gcpatch_startup.py"],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
        )
        return head.stdout.strip() + (
            " + uncommitted gcpatch changes" if dirty.stdout.strip() else ""
        )
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the smallest setting (seconds; figures meaningless)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write RESULTS.md, results.png, results.json (default: benchmarks/; "
        "--smoke requires it, so that the committed results are never overwritten)",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite RESULTS.md and results.png from an existing results.json in --out",
    )
    opts = parser.parse_args(argv)
    if opts.render_only:
        out = (opts.out or HERE).resolve()
        raw = json.loads((out / "results.json").read_text())["raw"]
        s = summarise(raw)
        (out / "results.json").write_text(
            json.dumps({"raw": raw, "summary": s}, indent=1, default=str)
        )
        plot_note = plot(raw, s, out / "results.png")
        write_results(raw, s, out, raw.get("smoke", False), plot_note)
        return 0
    if opts.smoke and opts.out is None:
        parser.error(
            "--smoke needs --out DIR (the committed results are not overwritten by a smoke run)"
        )
    out = (opts.out or HERE).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = (out / ".work") if opts.smoke else HERE / ".work"
    work.mkdir(parents=True, exist_ok=True)
    cfg = SMOKE if opts.smoke else FULL
    try:
        import torch  # noqa: F401  (checked here, used by the children)
        import transformers  # noqa: F401

        gcpatch_version = metadata.version("gcpatch")
    except (ImportError, metadata.PackageNotFoundError) as exc:
        sys.stderr.write(
            f"run.py needs gcpatch, torch and transformers installed in this environment ({exc})\n"
        )
        return 2
    if os.environ.get("GCPATCH") or "gcpatch" in sys.modules:
        log(
            "note: this driver's own process ignores GCPATCH; every measurement runs in a fresh child"
        )

    started = time.perf_counter()
    raw: dict = {"config": cfg, "smoke": opts.smoke}
    raw["startup"] = bench_startup(cfg, work)
    raw["enable"] = bench_enable(cfg)
    raw["cases"] = bench_cases(cfg)
    raw["env"] = {
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": metadata.version("torch"),
        "transformers": metadata.version("transformers"),
        "gcpatch": gcpatch_version,
        "cpus": os.cpu_count(),
        "run_s": time.perf_counter() - started,
        "commit": _commit(),
    }
    s = summarise(raw)
    (out / "results.json").write_text(json.dumps({"raw": raw, "summary": s}, indent=1, default=str))
    plot_note = plot(raw, s, out / "results.png")
    path = write_results(raw, s, out, opts.smoke, plot_note)
    log(
        f"wrote {path}"
        + ("" if plot_note.startswith("skipped") else f" and {out / 'results.png'}")
        + (f" (plot {plot_note})" if plot_note.startswith("skipped") else "")
    )
    print(path.read_text().split("## 1.")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
