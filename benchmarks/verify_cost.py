"""What verify mode (GCPATCH_VERIFY=1) costs: once, at the first training step, and after it.

    python benchmarks/verify_cost.py                 # writes benchmarks/VERIFY_COST.md
    python benchmarks/verify_cost.py --smoke --out DIR

Runs a plain training loop (Llama from a config, checkpointing on, AdamW) in fresh processes,
GCPATCH=1 with and without GCPATCH_VERIFY=1, interleaved round by round; each reports every
step's wall time, the peak RSS after step one, the activation bytes the user's own step saves,
the hooks left on the model, and verify's own record (its time, the slice's saved bytes).
Nothing is downloaded.
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
    steps=8,
    batch=4,
    seq=256,
    model=dict(
        num_hidden_layers=4,
        hidden_size=256,
        intermediate_size=688,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=512,
        attention_dropout=0.1,
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
        attention_dropout=0.1,
    ),
)


def worker(cfg: dict) -> dict:
    """One process: the user's loop. Timed steps; nothing of gcpatch is imported here."""
    import resource
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **cfg["model"])).train()
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["model"]["vocab_size"], (cfg["batch"], cfg["seq"]), generator=gen)
    times, saved, rss_after_first = [], 0, 0
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for step in range(cfg["steps"]):
        counted = [0]

        def pack(t):  # activations only, as verify counts them: weights saved for backward are not
            if t.untyped_storage().data_ptr() not in weights:
                counted[0] += t.numel() * t.element_size()
            return t

        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if (
            step == 1
        ):  # verify refuses to run inside saved-tensor hooks, so step 0 is not measured this way
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(input_ids=ids, labels=ids).loss
            saved = counted[0]
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        if step == 0:
            rss_after_first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gcpatch = sys.modules.get("gcpatch")
    records = [e for e in gcpatch.decisions() if e.get("stage") == "verify"] if gcpatch else []
    return {
        "times": times,
        "rss_after_first_step": rss_after_first,
        "user_step_saved_bytes_step2": saved,
        "hooks_after": sum(
            len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()
        ),
        "verify": records[0]["verify"] if records else None,
        "verify_line": records[0]["line"] if records else None,
    }


def run_worker(cfg: dict, verify: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCPATCH")}
    env.update(GCPATCH="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", GCPATCH_LOG="warning")
    if verify:
        env["GCPATCH_VERIFY"] = "1"
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd="/",
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(cfg: dict) -> dict:
    runs: dict[str, list[dict]] = {"verify": [], "plain": []}
    for r in range(cfg["rounds"]):
        for name in ("verify", "plain") if r % 2 == 0 else ("plain", "verify"):
            runs[name].append(run_worker(cfg, name == "verify"))
    return runs


def summarize(cfg: dict, runs: dict) -> dict:
    def first(name):
        return statistics.median(run["times"][0] for run in runs[name])

    def later(name):
        return statistics.median(t for run in runs[name] for t in run["times"][1:])

    rep = runs["verify"][0]["verify"]
    return {
        "first_step_s": {"verify": first("verify"), "plain": first("plain")},
        "later_steps_s": {"verify": later("verify"), "plain": later("plain")},
        "verify_seconds": statistics.median(run["verify"]["seconds"] for run in runs["verify"]),
        "slice_saved_bytes_plain": rep["saved_bytes_plain"],
        "slice_saved_bytes_checkpointed": rep["saved_bytes_checkpointed"],
        "user_step_saved_bytes": runs["plain"][0]["user_step_saved_bytes_step2"],
        "user_step_saved_bytes_verify_run": runs["verify"][0]["user_step_saved_bytes_step2"],
        "rss_after_first_mb": {
            k: statistics.median(r["rss_after_first_step"] for r in runs[k]) / 2**20 for k in runs
        },
        "hooks_after": {k: sorted({r["hooks_after"] for r in runs[k]}) for k in runs},
        "verify_line": runs["verify"][0]["verify_line"],
        "rows": rep["rows"],
        "batch": rep["batch"],
    }


def section(cfg: dict, s: dict, meta: str) -> str:
    f, l = s["first_step_s"], s["later_steps_s"]
    mb = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    return f"""# Verify mode (`GCPATCH_VERIFY=1`): one-time cost, and none after step one

Generated by `python benchmarks/verify_cost.py`. {meta}
Set-up: Llama {cfg["model"]["num_hidden_layers"]} layers, hidden {cfg["model"]["hidden_size"]}, vocab {cfg["model"]["vocab_size"]}, batch {cfg["batch"]} x {cfg["seq"]} tokens, AdamW, `gradient_checkpointing_enable()`, GCPATCH=1 in both variants, {cfg["rounds"]} fresh processes per variant, interleaved, {cfg["steps"]} steps each, 1 torch thread.

| what | with `GCPATCH_VERIFY=1` | without | |
| --- | --- | --- | --- |
| first training step (median) | {f["verify"]:.3f} s | {f["plain"]:.3f} s | +{f["verify"] - f["plain"]:.3f} s once ({f["verify"] / f["plain"]:.2f}x); verify's own record says {s["verify_seconds"]:.3f} s |
| each later step (median of steps 2..{cfg["steps"]}) | {l["verify"]:.3f} s | {l["plain"]:.3f} s | {l["verify"] / l["plain"]:.3f}x (no hook of verify is left: hooks on the model after training {s["hooks_after"]["verify"]} vs {s["hooks_after"]["plain"]}) |
| activation bytes the user's step saves (step 2) | {mb(s["user_step_saved_bytes_verify_run"])} | {mb(s["user_step_saved_bytes"])} | unchanged |
| extra activation bytes held once by verify (its no-checkpointing pass on {s["rows"]} of {s["batch"]} rows; the checkpointed pass holds {mb(s["slice_saved_bytes_checkpointed"])}) | {mb(s["slice_saved_bytes_plain"])} | - | {s["slice_saved_bytes_plain"] / s["user_step_saved_bytes"]:.2f}x the user's checkpointed step; freed before the user's forward runs |
| peak RSS after the first step (median) | {s["rss_after_first_mb"]["verify"]:.0f} MiB | {s["rss_after_first_mb"]["plain"]:.0f} MiB | |

The verify line of the first process: `{s["verify_line"]}`

Verify runs two passes on a slice of the batch (one with checkpointing as applied, one without) before the
user's first forward, so its memory is never added to the user's activations; after that it is gone: no hook,
no wrapper, and later steps run exactly the code of a run without it (the ratio above is machine noise).
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
    summary = summarize(cfg, runs)
    import torch  # noqa: F401 (versions only)
    import transformers

    meta = (
        f"Measured {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, torch {sys.modules['torch'].__version__}, transformers "
        f"{transformers.__version__}, {os.cpu_count()} CPUs shared with other jobs, no GPU; {time.time() - start:.0f} s."
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verify_cost.json").write_text(
        json.dumps({"config": cfg, "summary": summary, "runs": runs}, indent=1)
    )
    text = section(cfg, summary, meta)
    (args.out / "VERIFY_COST.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
