"""What gcpatch costs a training step, with steps short enough that a per-call cost would show.

    python benchmarks/step_cost.py --python /path/tf524/bin/python --python /path/tf457/bin/python
    python benchmarks/step_cost.py --table-only      # regenerate STEP_COST.md from STEP_COST.json

A tiny Llama (4 layers, hidden 64, batch 2 x 64 tokens, fp32, one CPU thread), all trainable, with
non-reentrant checkpointing asked for (a set-up plain runs correctly, so both sides do the same
work: a partly frozen model under 4.57's reentrant default skips its layers' backward plainly,
faster because wrong), trained with SGD: a step of a few milliseconds, in which each of the 4 checkpoint calls goes through gcpatch's hot path
(`checkpoint_call.run`). Fresh interpreters, plain (GCPATCH=0) and gcpatch (GCPATCH=1) alternating
round by round; in each, 30 warm-up steps, then every step timed by the process's CPU time (other
jobs on a shared machine do not count). Per round: the median step and the fastest decile's mean;
the table gives the medians over rounds and gcpatch's ratio to plain. The per-call cost of the hot
path itself is benchmarks/CHECKPOINT_CALL.md's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from _releases import child_env, main, run_worker

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "STEP_COST.json"
TABLE = HERE / "STEP_COST.md"
VARIANTS = ("plain", "gcpatch")

WORKER = r"""
import json, sys, time, statistics
import torch
from transformers import LlamaConfig, LlamaForCausalLM, __version__ as tf_version
torch.set_num_threads(1)
steps = int(sys.argv[1])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, tie_word_embeddings=False))
model.train()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
times = []
for step in range(30 + steps):
    start = time.process_time()
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    if step >= 30:
        times.append(time.process_time() - start)
times.sort()
fast = times[: max(1, len(times) // 10)]
print("RESULT " + json.dumps({"transformers": tf_version, "torch": torch.__version__,
                  "median_ms": statistics.median(times) * 1e3,
                  "fastest_decile_ms": statistics.mean(fast) * 1e3}))
"""


def run(python: str, variant: str, steps: int) -> dict:
    return run_worker(python, WORKER, [str(steps)], child_env(variant == "gcpatch"))


def measure(python: str, args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for index in range(args.rounds):
        order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            runs[variant].append(run(python, variant, args.steps))
            print(
                f"  round {index + 1} {variant}: {runs[variant][-1]['median_ms']:.3f} ms",
                file=sys.stderr,
            )
    out = {
        v: {
            "median_ms": statistics.median(r["median_ms"] for r in rs),
            "fastest_decile_ms": statistics.median(r["fastest_decile_ms"] for r in rs),
            "rounds_median_ms": [round(r["median_ms"], 4) for r in rs],
        }
        for v, rs in runs.items()
    }
    return {"torch": runs["plain"][0]["torch"], "steps": args.steps, "variants": out}


def table(results: dict) -> str:
    lines = [
        "# A training step with and without gcpatch (CPU)",
        "",
        "Reproduce: `python benchmarks/step_cost.py --python <venv>/bin/python ...` (one venv per "
        "transformers release; this file is generated from STEP_COST.json). A tiny Llama, 4 "
        "checkpointed layers, all trainable, `use_reentrant=False` asked (plain is correct there), SGD, "
        "2 x 64 tokens, one CPU thread; fresh interpreters alternating plain and GCPATCH=1 round by "
        "round, 30 warm-up steps, each step's process CPU time. Goal: gcpatch <= 1.005x plain. "
        "No GPU was lent for these figures: the GPU run of the same script is still to do.",
        "",
        "| transformers | torch | rounds x steps | plain median (ms) | gcpatch median (ms) | ratio "
        "| plain fastest decile (ms) | gcpatch fastest decile (ms) | ratio | goal <= 1.005x |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for release, entry in sorted(results.items()):
        plain, ours = entry["variants"]["plain"], entry["variants"]["gcpatch"]
        ratio = ours["median_ms"] / plain["median_ms"]
        fast = ours["fastest_decile_ms"] / plain["fastest_decile_ms"]
        rounds = len(plain["rounds_median_ms"])
        lines.append(
            f"| {release} | {entry['torch']} | {rounds} x {entry['steps']} | "
            f"{plain['median_ms']:.3f} | {ours['median_ms']:.3f} | {ratio:.4f}x | "
            f"{plain['fastest_decile_ms']:.3f} | {ours['fastest_decile_ms']:.3f} | {fast:.4f}x | "
            f"{'met' if ratio <= 1.005 else '**missed**'} |"
        )
    lines += [
        "",
        "Per round (median step, ms), plain then gcpatch:",
        "",
    ]
    for release, entry in sorted(results.items()):
        v = entry["variants"]
        lines.append(
            f"- {release} ({entry['when']}, {entry['machine']}): plain {v['plain']['rounds_median_ms']};"
            f" gcpatch {v['gcpatch']['rounds_median_ms']}"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    main(parser, measure, table, RESULTS, TABLE)
