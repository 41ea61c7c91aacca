"""What GCPATCH=1 costs a process that imports a framework and may never checkpoint, and what the
first enable costs once the plugins load there.

    python benchmarks/import_cost.py --python /path/tf524/bin/python --python /path/tf457/bin/python
    python benchmarks/import_cost.py --table-only     # regenerate IMPORT_COST.md from IMPORT_COST.json

Paired runs: each round runs the same code in a fresh interpreter with GCPATCH=0 and GCPATCH=1,
in alternating order (ABBA), and times inside the process: `import torch`, `import transformers`
(each the first framework import of its process: gcpatch arms its patch points there), and on a
tiny Llama the first `gradient_checkpointing_enable()` (gcpatch's plugins load there) and the
first enable of a second model. Times are the process's CPU time (`time.process_time`): other
jobs on a shared machine do not count. A figure is the median over rounds of the paired difference.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _releases import child_env, main, run_worker

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "IMPORT_COST.json"
TABLE = HERE / "IMPORT_COST.md"
TARGET_IMPORT_MS = 20.0

CODES = {
    "import torch": "import time; t = time.process_time(); import torch; d = {'import torch': time.process_time() - t}",
    "import transformers": "import time; t = time.process_time(); import transformers; "
    "d = {'import transformers': time.process_time() - t}",
    "enable": """
import time, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
def tiny():
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
a, b = tiny(), tiny()
t = time.process_time(); a.gradient_checkpointing_enable(); first = time.process_time() - t
t = time.process_time(); b.gradient_checkpointing_enable(); second = time.process_time() - t
d = {'first enable in the process': first, "a second model's first enable": second}
""",
}
ROWS = (
    "import torch",
    "import transformers",
    "first enable in the process",
    "a second model's first enable",
)
TAIL = "\nimport json; print('RESULT ' + json.dumps(d))"


def once(python: str, code: str, gcpatch: bool) -> dict:
    return run_worker(python, code + TAIL, [], child_env(gcpatch, GCPATCH_LOG="off"), timeout=300)


def measure(python: str, args: argparse.Namespace) -> dict:
    pairs: dict[str, list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for code in CODES.values():
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {flag: once(python, code, flag) for flag in order}
            for name in got[False]:
                pairs.setdefault(name, []).append((got[False][name] * 1000, got[True][name] * 1000))
    out = {}
    for name, values in pairs.items():
        plain = statistics.median(p for p, _ in values)
        gc = statistics.median(g for _, g in values)
        out[name] = {
            "plain_ms": plain,
            "gcpatch_ms": gc,
            "added_ms": statistics.median(g - p for p, g in values),
            "ratio": statistics.median(g / p for p, g in values),
            "rounds": len(values),
        }
    return {"figures": out, "rounds": args.rounds}


def table(results: dict) -> str:
    lines = [
        "# GCPATCH=1 at import and at the first enable",
        "",
        "Reproduce: `python benchmarks/import_cost.py --python <venv>/bin/python ...` (this file is generated "
        "from IMPORT_COST.json). Paired fresh interpreters (GCPATCH=0 / GCPATCH=1, alternating order), CPU "
        "time of the process taken inside it; figures are medians over rounds. At the first framework import gcpatch only "
        "arms its patch points (no pluggy, no entry-point scan, no plugin, no crash notes); the plugins load at "
        "the first call through a patch point, here the first enable.",
        "",
    ]
    for release, entry in sorted(results.items()):
        lines += [
            f"## transformers {release} ({entry['when']}, {entry['machine']}, {entry['rounds']} rounds)",
            "",
            "| what | plain (ms) | GCPATCH=1 (ms) | added (ms) | ratio | target |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name in sorted(entry["figures"], key=ROWS.index):  # the JSON keeps its keys sorted
            f = entry["figures"][name]
            target = ""
            if name.startswith("import"):
                target = f"<= +{TARGET_IMPORT_MS:.0f} ms: " + (
                    "met" if f["added_ms"] <= TARGET_IMPORT_MS else "**missed**"
                )
            lines.append(
                f"| {name} | {f['plain_ms']:.1f} | {f['gcpatch_ms']:.1f} | {f['added_ms']:+.2f} | "
                f"{f['ratio']:.3f}x | {target} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    main(parser, measure, table, RESULTS, TABLE)
