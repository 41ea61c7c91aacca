"""GCPATCH_MEMORY_BUDGET on a job whose batches change length at every step: does the budget hold on
every step, at how much more recompute than a plan that knew every shape in advance, and what does
planning cost per step?

    python benchmarks/budget_shapes.py            # writes benchmarks/BUDGET_SHAPES.md, budget_shapes.json
    python benchmarks/budget_shapes.py --quick --out /tmp/x

A 12-layer Llama (hidden 64, eager attention, batch 2), token counts drawn from 32..1024 (seeded)
and padded to a multiple of 32,
under GCPATCH_MEMORY_BUDGET=0.5 and under an absolute size (half of what a 512-token step holds
without checkpointing). The real path: the variable set, the user's own enable and loop; gcpatch
measures the model at the first step and plans every later step by its shape. Per step:
  held      what the forward holds for its backward (gcpatch/step/held.py's instrument)
  limit     0.5 x that step's own bytes without checkpointing (measured), or the size
  oracle    the least recompute any per-layer plan meeting that limit has, from the step's own
            costs measured exactly at its shape (every layer's bytes plain and checkpointed, and
            its forward seconds), solved exactly (gcpatch/step/solver.py)
  recompute the seconds of the layers gcpatch's plan checkpoints, by the same measured costs
Planning time: the pre-hook's own time per step (a seen shape: a cache lookup; a new shape: the
cost model and the solver), timed around the hook, over the steps of each kind.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYERS, HIDDEN, BATCH, VOCAB = 12, 64, 2, 256
FULL = {"steps": 60, "lengths": (32, 1024)}
QUICK = {"steps": 8, "lengths": (32, 256)}
TOLERANCE = 0.05


def model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        use_cache=False,
        max_position_embeddings=2048,
    )
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).train()


def lengths(cfg: dict) -> list[int]:
    rng = random.Random(7)
    low, high = cfg["lengths"]
    # padded to a multiple of 32, as a collator with pad_to_multiple_of=32 makes them: shapes recur
    return [32 * -(-rng.randint(low, high) // 32) for _ in range(cfg["steps"])]


def batch(tokens: int):
    import torch

    gen = torch.Generator().manual_seed(tokens)
    return torch.randint(0, VOCAB, (BATCH, tokens), generator=gen)


def true_costs(m, ids) -> tuple[list, float]:
    """Every layer's cost measured exactly at this shape (no model): bytes plain and checkpointed
    from one plain forward, seconds from a no-grad pass."""
    import torch

    from gcpatch.step import invisible
    from gcpatch.step.held import OUTSIDE, Held
    from gcpatch.step.layer_costs import _averaged, _sync, _time_layers
    from gcpatch.step.solver import LayerCost

    layers = list(m.model.layers)
    flags = [layer.gradient_checkpointing for layer in layers]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        with invisible.gcpatch_pass(torch, m):  # no per-shape plan for these passes
            held = Held(layers)
            with held:
                out = m(input_ids=ids, labels=ids)
            graph = out.loss.grad_fn
            del out
            alive = held.alive()
            costs = [(alive.get(i, 0), held.checkpointed(i)) for i in range(len(layers))]
            outside = alive.get(OUTSIDE, 0)
            del graph, held
            seconds = _time_layers(layers, lambda: m(input_ids=ids), _sync(m))
    finally:
        for layer, flag in zip(layers, flags):
            layer.gradient_checkpointing = flag
    # identical layers hold the same bytes and run the same kernels: one mean time for them, so the
    # oracle's choice among them is not timing noise (gcpatch's own model does the same)
    seconds = _averaged(
        seconds, ["layer"] * len(layers), [p for p, _ in costs], [c for _, c in costs]
    )
    out = [LayerCost(f"{i}", p, min(c, p), s) for i, ((p, c), s) in enumerate(zip(costs, seconds))]
    return out, float(outside)


def run(budget: str, cfg: dict) -> dict:
    from gcpatch.step import shapes, solver
    from gcpatch.step.held import held_bytes

    os.environ["GCPATCH_MEMORY_BUDGET"] = budget
    try:
        m = model()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        plans = None
        hook_s: dict[str, list[float]] = {"seen": [], "new": []}
        steps = []
        for index, tokens in enumerate(lengths(cfg)):
            ids = batch(tokens)
            if plans is not None:
                seen = any(k[:2] == (BATCH, tokens) for k in plans.plans)
                start = time.perf_counter()
                plans(m, (), {"input_ids": ids, "labels": ids})  # what the pre-hook runs
                hook_s["seen" if seen else "new"].append(time.perf_counter() - start)
            with held_bytes() as h:
                loss = m(input_ids=ids, labels=ids).loss
                held = h.total()
            loss.backward()
            m.zero_grad(set_to_none=True)
            plans = shapes.of(m) or plans
            if index == 0:
                continue  # the first step ran fully checkpointed while it was measured
            flags = [layer.gradient_checkpointing for layer in m.model.layers]
            costs, outside = true_costs(m, ids)
            plain = outside + sum(c.plain for c in costs)
            limit = 0.5 * plain if budget == "0.5" else float(budget[:-1])
            oracle = solver.solve(costs, outside, limit)
            steps.append(
                {
                    "tokens": tokens,
                    "held": held,
                    "plain": plain,
                    "limit": limit,
                    "floor": oracle.floor,
                    "within": held <= limit * (1 + TOLERANCE)
                    or (all(flags) and limit < oracle.floor),
                    "recompute_s": sum(c.seconds for c, f in zip(costs, flags) if f),
                    "oracle_s": oracle.recompute_s,
                    "full_s": sum(c.seconds for c in costs),
                    "checkpointed": sum(flags),
                    "oracle_checkpointed": oracle.count,
                }
            )
    finally:
        os.environ.pop("GCPATCH_MEMORY_BUDGET", None)
    return {"budget": budget, "steps": steps, "hook_s": hook_s}


def summarise(result: dict) -> dict:
    steps = result["steps"]
    ours = sum(s["recompute_s"] for s in steps)
    oracle = sum(s["oracle_s"] for s in steps)
    full = sum(s["full_s"] for s in steps)
    hooks = result["hook_s"]
    return {
        "budget": result["budget"],
        "steps": len(steps),
        "within": sum(s["within"] for s in steps),
        "worst_over": max(s["held"] / s["limit"] for s in steps),
        "recompute_vs_oracle": ours / oracle if oracle else 1.0,
        "recompute_vs_full": ours / full if full else 0.0,
        "oracle_vs_full": oracle / full if full else 0.0,
        "same_layers_as_oracle": sum(s["checkpointed"] == s["oracle_checkpointed"] for s in steps),
        "hook_seen_ms": 1e3 * statistics.median(hooks["seen"]) if hooks["seen"] else None,
        "hook_new_ms": 1e3 * statistics.median(hooks["new"]) if hooks["new"] else None,
        "hook_new_max_ms": 1e3 * max(hooks["new"]) if hooks["new"] else None,
        "new_shapes": len(hooks["new"]),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def write(rows: list[dict], raw: dict, out: Path, meta: str, cfg: dict) -> None:
    lines = [
        "# The memory budget on every step: batches of changing length",
        "",
        f"Generated by `python benchmarks/budget_shapes.py`. {meta}",
        "",
        f"Set-up: Llama {LAYERS} layers, hidden {HIDDEN}, eager attention, batch {BATCH}, "
        f"{cfg['steps']} steps of {cfg['lengths'][0]}..{cfg['lengths'][1]} tokens (seeded), fp32, "
        "the real path (the variable set, the user's enable and loop). The first step runs fully "
        "checkpointed while the model is measured; the figures are those of the other steps.",
        "",
        "| budget | steps within budget (+5%) or at the floor | worst held / limit | recompute vs the "
        "per-step oracle | recompute vs full checkpointing | oracle vs full | steps with the oracle's "
        "layer count | pre-hook per step, seen shape | pre-hook, new shape (median / max) | new shapes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['budget']} | {r['within']} of {r['steps']} | {r['worst_over']:.3f} | "
            f"{r['recompute_vs_oracle']:.3f} | {r['recompute_vs_full']:.3f} | "
            f"{r['oracle_vs_full']:.3f} | {r['same_layers_as_oracle']} of {r['steps']} | "
            f"{_ms(r['hook_seen_ms'])} | {_ms(r['hook_new_ms'])} / {_ms(r['hook_new_max_ms'])} | "
            f"{r['new_shapes']} |"
        )
    lines += [
        "",
        "Goals: every step within the budget (100%); recompute within 5% of the per-step oracle's "
        "(an oracle that knows every shape and measures it exactly); planning a seen shape costs "
        "nothing measurable, a new one at most 1 ms. Recompute is in measured forward seconds of the "
        "checkpointed layers at each step's own shape (CPU; one run, so seconds carry timing noise: "
        "the oracle's and gcpatch's plans are judged by the same figures).",
        "",
        "Plot: `budget_shapes.png` (each step's held bytes against its budget, and its recompute"
        " against the oracle's, by token count; `--plot-only` redraws it from the JSON).",
        "",
    ]
    (out / "BUDGET_SHAPES.md").write_text("\n".join(lines))
    (out / "budget_shapes.json").write_text(json.dumps(raw, indent=1))


def plot(raw: dict, path: Path) -> str:
    """Per budget: each step's held bytes against its limit (1.0 = the budget) by its token count,
    and the recompute of gcpatch's plan against the per-step oracle's."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for result, style in zip(raw["runs"], ("o", "s")):
        steps = result["steps"]
        tokens = [s["tokens"] for s in steps]
        label = f"budget {result['budget']}"
        axes[0].plot(tokens, [s["held"] / s["limit"] for s in steps], style, label=label, ms=4)
        axes[1].plot(
            tokens,
            [s["recompute_s"] / s["oracle_s"] if s["oracle_s"] else 1.0 for s in steps],
            style,
            label=label,
            ms=4,
        )
    axes[0].axhline(1 + TOLERANCE, color="grey", lw=0.8, label="budget +5%")
    axes[0].set(xscale="log", xlabel="tokens in the step", ylabel="held / budget")
    axes[1].set(xscale="log", xlabel="tokens in the step", ylabel="recompute / per-step oracle")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return "written"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the JSON")
    args = parser.parse_args()
    if args.plot_only:
        raw = json.loads((args.out / "budget_shapes.json").read_text())
        print(plot(raw, args.out / "budget_shapes.png"))
        return 0
    cfg = QUICK if args.quick else FULL
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    import gcpatch  # noqa: F401 (the benchmark measures gcpatch's own path)

    torch.set_num_threads(1)
    start = time.time()
    size_ref = model()
    ids = batch(512 if not args.quick else 128)
    from gcpatch.step.held import held_bytes

    with held_bytes() as h:
        loss = size_ref(input_ids=ids, labels=ids).loss
        half = h.total() // 2
    del loss, size_ref
    raw = {"config": cfg, "runs": [run("0.5", cfg), run(f"{half}B", cfg)]}
    rows = [summarise(r) for r in raw["runs"]]
    import transformers

    meta = (
        f"Measured {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.system()} "
        f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {os.cpu_count()} CPUs shared with other jobs, "
        f"1 torch thread, no GPU; {time.time() - start:.0f} s."
    )
    args.out.mkdir(parents=True, exist_ok=True)
    write(rows, raw, args.out, meta, cfg)
    print(plot(raw, args.out / "budget_shapes.png"), json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
