"""What GCPATCH_MEMORY_BUDGET costs a job's first training steps, where the plan is made: the first
two steps' wall time under `GCPATCH_MEMORY_BUDGET=0.5` against full checkpointing (GCPATCH=1, the
variable unset), and the two steps after them.

    python benchmarks/budget_first_steps.py                  # writes benchmarks/BUDGET_FIRST_STEPS.md, budget_first_steps.json
    python benchmarks/budget_first_steps.py --smoke --out DIR

The model of integration/test_budget_job_steps.py's FLOPs check: an 8-layer Llama from a config
(hidden 256, intermediate 688, vocab 256, fp32, dropout 0), batch 2 x 256 tokens, all trainable,
`gradient_checkpointing_enable()`, AdamW, four steps (forward, backward, optimizer step), each
timed in wall seconds. Each run is a fresh process (the user's loop; nothing of gcpatch is imported
there), GCPATCH=1 in both variants; the variants alternate round by round, the first of each round
taking turns, and the table gives the median over the rounds. The budget's own line (its plan,
and what its measuring took) is quoted from the first budgeted run's stderr. torch's threads are
left as the machine gives them. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FULL = dict(
    rounds=3,
    steps=4,
    batch=2,
    seq=256,
    model=dict(
        num_hidden_layers=8,
        hidden_size=256,
        intermediate_size=688,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=1024,
        attention_dropout=0.0,
    ),
)
SMOKE = dict(
    rounds=1,
    steps=3,
    batch=2,
    seq=16,
    model=dict(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        attention_dropout=0.0,
    ),
)
BUDGET = "0.5"
VARIANTS = ("budget", "full")


def worker(cfg: dict) -> dict:
    """One process: the user's loop, every step timed. Nothing of gcpatch is imported here."""
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(tie_word_embeddings=False, use_cache=False, **cfg["model"])
    ).train()
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["model"]["vocab_size"], (cfg["batch"], cfg["seq"]), generator=gen)
    times = []
    for _ in range(cfg["steps"]):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    checkpointed = sum(
        bool(getattr(layer, "gradient_checkpointing", False)) for layer in model.model.layers
    )
    return {"times": times, "checkpointed": checkpointed, "threads": torch.get_num_threads()}


def run_worker(cfg: dict, variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCPATCH")}
    env.update(GCPATCH="1", HF_HUB_OFFLINE="1")
    if variant == "budget":
        env["GCPATCH_MEMORY_BUDGET"] = BUDGET
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        cwd="/",  # the installed gcpatch, never a checkout's
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["budget_lines"] = budget_lines(proc.stderr)
    return out


def budget_lines(stderr: str) -> list[str]:
    """gcpatch's budget lines, each whole (a long one wraps into indented rows)."""
    lines: list[str] = []
    for line in stderr.splitlines():
        if line.startswith("    ") and lines and lines[-1].startswith("gcpatch: "):
            lines[-1] += " " + line[4:]
        elif line.startswith("gcpatch: ") and " budget " in line:
            lines.append(line)
    return lines


def measure(cfg: dict) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(cfg["rounds"]):
        for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            runs[name].append(run_worker(cfg, name))
    return runs


def summarize(runs: dict) -> dict:
    def median(name: str, pick) -> float:
        return statistics.median(pick(run["times"]) for run in runs[name])

    rows = {
        "step 1": lambda t: t[0],
        "step 2": lambda t: t[1],
        "steps 1 + 2": lambda t: t[0] + t[1],
        "each later step": lambda t: statistics.median(t[2:]) if len(t) > 2 else float("nan"),
    }
    return {
        "rows": {
            label: {name: median(name, pick) for name in VARIANTS} for label, pick in rows.items()
        },
        "checkpointed": {name: sorted({r["checkpointed"] for r in runs[name]}) for name in runs},
        "threads": sorted({r["threads"] for name in runs for r in runs[name]}),
        "budget_line": next((line for r in runs["budget"] for line in r["budget_lines"]), ""),
    }


def section(cfg: dict, s: dict, meta: str) -> str:
    m = cfg["model"]
    table = "\n".join(
        f"| {label} | {v['budget']:.2f} s | {v['full']:.2f} s | {v['budget'] / v['full']:.2f}x |"
        for label, v in s["rows"].items()
    )
    layers = m["num_hidden_layers"]
    return f"""# The memory budget's first steps: `GCPATCH_MEMORY_BUDGET={BUDGET}` against full checkpointing

Generated by `python benchmarks/budget_first_steps.py`. {meta}
Set-up: Llama {layers} layers, hidden {m["hidden_size"]}, vocab {m["vocab_size"]}, batch {cfg["batch"]} x {cfg["seq"]} tokens, fp32, AdamW, `gradient_checkpointing_enable()`, GCPATCH=1 in both variants, {cfg["rounds"]} fresh processes per variant, interleaved, {cfg["steps"]} steps each (forward, backward, optimizer step), wall seconds, torch threads as the machine gives them ({", ".join(map(str, s["threads"]))}).

| step (median over the runs) | budget {BUDGET} | full checkpointing | budget / full |
| --- | --- | --- | --- |
{table}

Layers checkpointed after the plan: {s["checkpointed"]["budget"]} of {layers} with the budget, {s["checkpointed"]["full"]} of {layers} without.

The budget's line in the first budgeted run: `{s["budget_line"]}`
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    cfg = SMOKE if args.smoke else FULL
    start = time.time()
    runs = measure(cfg)
    summary = summarize(runs)
    import torch  # noqa: F401 (versions only)
    import transformers

    meta = (
        f"Measured {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, torch {sys.modules['torch'].__version__}, transformers "
        f"{transformers.__version__}, {os.cpu_count()} CPUs shared with other jobs, no GPU; {time.time() - start:.0f} s."
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "budget_first_steps.json").write_text(
        json.dumps({"config": cfg, "summary": summary, "runs": runs}, indent=1)
    )
    text = section(cfg, summary, meta)
    (args.out / "BUDGET_FIRST_STEPS.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
