"""GCPATCH_MEMORY_BUDGET on a job whose batches change length at every step: does the budget hold on
every step, at how much more recompute than a plan that knew every shape in advance, and what does
planning cost per step?

    python benchmarks/budget_shapes.py            # writes benchmarks/BUDGET_SHAPES.md, budget_shapes.json
    python benchmarks/budget_shapes.py --quick --out /tmp/x

A 12-layer Llama (hidden 64, eager attention, batch 2), token counts drawn from 32..1024 (seeded)
and padded to a multiple of 32,
under GCPATCH_MEMORY_BUDGET=0.5 and under an absolute size (half of what a 512-token step holds
without checkpointing). The real path: the variable set, the user's own enable and loop; gcpatch
probes the first step (run fully checkpointed), builds its cost model from it, and plans every
later step by its shape from that model. Per step:
  held      what the forward holds for its backward (gcpatch/step/held.py's instrument)
  limit     0.5 x that step's own bytes without checkpointing, or the size
  oracle    the least recompute any per-layer plan meeting that limit has, from the step's own
            costs measured exactly at its shape: the probe gcpatch runs on the first step
            (gcpatch/step/probe.py) run here on a twin of the model at every shape (once per
            shape, in this process, not in the user's job), its cost model read at that very
            shape (bytes plain and under each lever, recompute seconds), solved by
            gcpatch/step/solver.py
  recompute the seconds gcpatch's plan recomputes, priced by the same exact costs
Planning time: the pre-hook's own time per step (a seen shape: a cache lookup; a new shape: the
cost model read at it and the solver), timed around the hook, over the steps of each kind.
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


def twin():
    """The model again, checkpointing on every layer as the user enabled it, with no budget: the
    oracle's costs are probed on it, so the user's model sees nothing but its own steps."""
    asked = os.environ.pop("GCPATCH_MEMORY_BUDGET", None)
    try:
        m = model()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    finally:
        if asked is not None:
            os.environ["GCPATCH_MEMORY_BUDGET"] = asked
    return m


def exact_costs(ref, tokens: int, cache: dict) -> tuple[list, float, float]:
    """Every layer's costs measured at this very shape: one fully checkpointed step of `ref`
    probed as gcpatch probes the first step, its cost model read at the shape it was probed at
    (nothing extrapolated). (layer costs, bytes outside the layers, bytes without
    checkpointing); once per shape."""
    if tokens in cache:
        return cache[tokens]
    from gcpatch.step import cost_model
    from gcpatch.step.levers import feed_forward
    from gcpatch.step.probe import Probe

    ids = batch(tokens)
    layers = list(ref.model.layers)
    probe = Probe(layers, [feed_forward.block(m) for m in layers], (BATCH, tokens), False)
    probe.start()
    try:
        out = ref(input_ids=ids, labels=ids)
        probe.forward_done()
        out.loss.backward()
    finally:
        facts = probe.finish()
        ref.zero_grad(set_to_none=True)
    assert facts.complete and not probe.failed, probe.failed
    funcs = [vars(m).get("_gradient_checkpointing_func") for m in layers]
    costs = cost_model.build(facts, layers, funcs)
    cache[tokens] = costs.at(BATCH, tokens)
    return cache[tokens]


def priced(costs: list, modes: list[str]) -> float:
    """The recompute of a plan's modes by these costs (a lever the shape's own probe did not
    offer: priced as a whole recompute)."""
    from gcpatch.step.solver import PLAIN

    return sum(
        0.0 if mode == PLAIN else c.cost_by.get(mode, c.seconds) for c, mode in zip(costs, modes)
    )


def counts(modes: list[str]) -> dict[str, int]:
    """How many layers run in each mode."""
    return {mode: modes.count(mode) for mode in sorted(set(modes))}


def timed_hook(plans, hook_s: dict[str, list[float]]) -> None:
    """The pre-hook's own work at each forward, timed where it runs (a shape seen before, or
    new), so that the step still runs it once."""
    before = plans._before

    def timed(args: tuple, kwargs: dict) -> None:
        found = shape_of(kwargs)
        seen = any(key[:2] == found for key in plans.plans)
        start = time.perf_counter()
        before(args, kwargs)
        hook_s["seen" if seen else "new"].append(time.perf_counter() - start)

    plans._before = timed


def shape_of(kwargs: dict) -> tuple[int, int]:
    rows, tokens = kwargs["input_ids"].shape
    return int(rows), int(tokens)


def run(budget: str, cfg: dict, ref, cache: dict) -> dict:
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
            with held_bytes() as h:
                loss = m(input_ids=ids, labels=ids).loss
                held = h.total()
            loss.backward()
            m.zero_grad(set_to_none=True)
            if index == 0:
                continue  # the first step ran fully checkpointed while it was probed
            if plans is None:  # made at this step's forward: its pre-hook timed from now on
                plans = shapes.of(m)
                assert plans is not None, "no plan after the first step"
                timed_hook(plans, hook_s)
            modes = list(plans.last.modes)  # the plan this step's pre-hook applied
            costs, outside, plain = exact_costs(ref, tokens, cache)
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
                    or (limit < oracle.floor and all(mode != solver.PLAIN for mode in modes)),
                    "recompute_s": priced(costs, modes),
                    "oracle_s": oracle.recompute_s,
                    "full_s": oracle.full_recompute_s,
                    "modes": counts(modes),
                    "oracle_modes": counts(oracle.modes),
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
        "same_plan_as_oracle": sum(s["modes"] == s["oracle_modes"] for s in steps),
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
        "checkpointed while gcpatch probes it; the figures are those of the other steps.",
        "",
        "| budget | steps within budget (+5%) or at the floor | worst held / limit | recompute vs the "
        "per-step oracle | recompute vs full checkpointing | oracle vs full | steps with the oracle's "
        "plan (layers per lever) | pre-hook per step, seen shape | pre-hook, new shape (median / max) | new shapes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['budget']} | {r['within']} of {r['steps']} | {r['worst_over']:.3f} | "
            f"{r['recompute_vs_oracle']:.3f} | {r['recompute_vs_full']:.3f} | "
            f"{r['oracle_vs_full']:.3f} | {r['same_plan_as_oracle']} of {r['steps']} | "
            f"{_ms(r['hook_seen_ms'])} | {_ms(r['hook_new_ms'])} / {_ms(r['hook_new_max_ms'])} | "
            f"{r['new_shapes']} |"
        )
    lines += [
        "",
        "Goals: every step within the budget (100%); recompute within 5% of the per-step oracle's "
        "(an oracle that knows every shape and measures it exactly); planning a seen shape costs "
        "nothing measurable, a new one at most 1 ms. Recompute is in seconds of each step's own "
        "shape as its probe measured them: each layer's recompute timed in the backward, each "
        "lever's share of it as gcpatch prices levers (CPU; one probed step per shape, so seconds "
        "carry timing noise: the oracle's and gcpatch's plans are judged by the same figures). "
        "Among plans within 5% of full checkpointing's recompute of the cheapest the solver takes "
        "the one recomputing the fewest matmul FLOPs, so either plan may recompute a little more "
        "than the other.",
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
    ref, cache = twin(), {}  # the oracle's model, and its costs by shape (both runs share them)
    raw = {"config": cfg, "runs": [run("0.5", cfg, ref, cache), run(f"{half}B", cfg, ref, cache)]}
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
