"""With attention dropout on a CPU, or on PEFT LoRA: is the budget's plan, chosen by measured time,
the fastest of the plans that meet the budget, against plans that recompute fewer matmul FLOPs?

    GCPATCH=1 python benchmarks/dropout_plans.py                  # writes DROPOUT_PLANS.md
    GCPATCH=1 python benchmarks/dropout_plans.py --setup lora     # writes LORA_PLANS.md
    GCPATCH=1 python benchmarks/dropout_plans.py --setup fused    # writes FUSED_PLANS.md

An 8-layer Llama (hidden 256, 2 x 1024 tokens, sdpa, fp32, attention dropout 0.1, non-reentrant),
the model of integration/test_budget_selective.py's dropout case. CPU attention with dropout runs
unfused, so a layer keeping its matmuls still recomputes softmax and dropout over tokens x tokens;
its measured cost decides how many layers the plan keeps that way and how many it checkpoints
whole. The first step plans under GCPATCH_MEMORY_BUDGET=0.5; then the model's checkpointing is
disabled (gcpatch leaves a disabled model alone) and each plan is set on the layers by hand:
gcpatch's own, every layer keeping its matmuls (no matmul recomputed), 2 whole and 5 keeping (a
quarter of full checkpointing's matmul FLOPs), two plans the planner chose on other runs (1 whole,
5 keeping, 1 plain, 1 feed-forward: 0.17 of the FLOPs; 3 whole, 1 keeping, 4 feed-forward: 0.54),
every layer with its feed-forward block alone
checkpointed (what that lever sheds where the attention's tensors dominate), full checkpointing
and none. Steps alternate plan by plan, `--rounds`
times; each is timed in the thread's CPU time on one compute thread (other jobs on a shared machine
do not count), with
the bytes its forward holds (gcpatch's instrument) and the matmul FLOPs its backward recomputes
(torch.utils.flop_counter over the step, forward and backward, CPU's fused attention kernel counted
with torch's formula, against the step without checkpointing).

`--setup lora`: the same model without dropout (fused attention) on PEFT LoRA (every projection,
the base frozen), integration/scripts/budget_selective.py's `lora`. A frozen projection's output
is held by no backward plainly, so keeping the matmuls holds nearly a plain layer there; the plans
are of the feed-forward block alone, the attention output kept and whole layers. `--setup fused`:
the same model without dropout (fused attention), against the plan the budget made at 0.5 when a
lever's cost was the difference of two steps (6 keeping their matmuls, 2 their attention output).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("GCPATCH_MEMORY_BUDGET", "0.5")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
BATCH, TOKENS, LAYERS = 2, 1024, 8
PLANS = {
    "keeping every layer's matmuls": ["keep-matmuls"] * LAYERS,
    "2 whole, 5 keeping, 1 plain": ["full", "keep-matmuls", "keep-matmuls", "plain"]
    + ["full", "keep-matmuls", "keep-matmuls", "keep-matmuls"],
    "1 whole, 5 keeping, 1 plain, 1 feed-forward": ["full", "keep-matmuls", "feed-forward"]
    + ["keep-matmuls"] * 4
    + ["plain"],
    "3 whole, 1 keeping, 4 feed-forward": ["full", "keep-matmuls", "full", "feed-forward"]
    + ["feed-forward", "full", "feed-forward", "feed-forward"],
    "every layer's feed-forward block alone": ["feed-forward"] * LAYERS,
    "full checkpointing": ["full"] * LAYERS,
    "no checkpointing": ["plain"] * LAYERS,
}
LORA_PLANS = {
    "keeping every layer's matmuls": ["keep-matmuls"] * LAYERS,
    "1 keeping its attention output, 7 feed-forward": ["keep-attention"]
    + ["feed-forward"] * (LAYERS - 1),
    "1 whole, 7 feed-forward": ["full"] + ["feed-forward"] * (LAYERS - 1),
    "4 keeping their attention output, 4 feed-forward": ["keep-attention"] * 4
    + ["feed-forward"] * 4,
    "every layer's feed-forward block alone": ["feed-forward"] * LAYERS,
    "full checkpointing": ["full"] * LAYERS,
    "no checkpointing": ["plain"] * LAYERS,
}


FUSED_PLANS = {
    "6 keeping, 2 keeping their attention output": ["keep-matmuls"] * 6 + ["keep-attention"] * 2,
    "1 keeping, 7 feed-forward": ["keep-matmuls"] + ["feed-forward"] * (LAYERS - 1),
    "4 keeping, 1 its attention output, 3 feed-forward": ["keep-matmuls"] * 4
    + ["keep-attention"]
    + ["feed-forward"] * 3,
    "full checkpointing": ["full"] * LAYERS,
    "no checkpointing": ["plain"] * LAYERS,
}
# --setup: (attention dropout, PEFT LoRA, the plans beside gcpatch's, the file it writes, its title)
SETUPS = {
    "dropout": (0.1, False, PLANS, "DROPOUT_PLANS.md", "With attention dropout"),
    "lora": (0.0, True, LORA_PLANS, "LORA_PLANS.md", "On PEFT LoRA"),
    "fused": (0.0, False, FUSED_PLANS, "FUSED_PLANS.md", "With fused attention"),
}


def build(dropout: float, lora: bool):
    """integration/scripts/budget_selective.py's model (with `dropout`, on PEFT LoRA where `lora`),
    checkpointing enabled, non-reentrant."""
    import budget_selective

    args = argparse.Namespace(dropout=dropout, dtype="float32")
    model = budget_selective.build(args)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        model = budget_selective.lora(model, args)
    return model.train()


def modes_of(layers) -> list[str]:
    """How each layer runs: plain, whole, around its MLP alone, or under a lever's policy (its
    name)."""
    from gcpatch.step import feed_forward

    out = []
    for m in layers:
        func = getattr(m, "_gradient_checkpointing_func", None)
        context = getattr(func, "keywords", {}).get("context_fn")
        if not m.gradient_checkpointing:
            out.append("plain")
        elif isinstance(func, feed_forward.FeedForward):
            out.append("feed-forward")
        else:
            out.append(getattr(getattr(context, "__self__", None), "lever", "full"))
    return out


def set_plan(layers, own, modes) -> None:
    from gcpatch.step import feed_forward, selective

    for m, func, mode in zip(layers, own, modes):
        m.gradient_checkpointing = mode != "plain"
        if mode in selective.LEVERS:
            func = selective.keeping(func, selective.Keep(mode))
        elif mode == "feed-forward":
            func = feed_forward.FeedForward(func, feed_forward.block(m))
        m._gradient_checkpointing_func = func


def seconds(model, ids, seed: int) -> float:
    """Thread seconds of one step's forward and backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    start = time.thread_time()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.thread_time() - start


def figures(model, ids) -> tuple[int, int]:
    """(bytes the forward holds for its backward, the step's matmul and attention FLOPs). The FLOP
    counter's module tracker sees the forward too: around a backward alone it breaks a selective
    checkpoint's recompute on PEFT LoRA ("aten.view.default invocation index 16 encountered during
    backward but not found in storage", torch 2.13, a user's own context_fn alike)."""
    from budget_selective import counting

    from gcpatch.step.held import held_bytes

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with held_bytes() as held:
        loss = model(input_ids=ids, labels=ids).loss
    nbytes = held.total(returned=loss)
    del loss
    torch.manual_seed(1)
    counter = counting()
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return nbytes, counter.get_total_flops()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--setup", choices=SETUPS, default="dropout")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent / "integration" / "scripts"))
    # one compute thread, so the thread's CPU time is the step's (memory_budget.py's clock)
    torch.set_num_threads(1)
    import gcpatch  # noqa: F401 (GCPATCH=1 armed it already; an import is the documented switch)

    dropout, lora, others, _, _ = SETUPS[args.setup]
    model = build(dropout, lora)
    from budget_selective import decoder_layers

    layers = decoder_layers(model)
    ids = torch.randint(0, 256, (BATCH, TOKENS), generator=torch.Generator().manual_seed(3))
    seconds(model, ids, 0)  # the first step: gcpatch measures and plans
    plans = {"gcpatch's plan": modes_of(layers), **others}
    own = [m._gradient_checkpointing_func for m in layers]
    model.gradient_checkpointing_disable()  # gcpatch leaves a disabled model alone
    from gcpatch.step import selective

    own = [selective.own(f) for f in own]
    measured = {}
    for name, modes in plans.items():  # a warm-up round, measuring bytes and FLOPs
        set_plan(layers, own, modes)
        measured[name] = figures(model, ids)
    times: dict[str, list[float]] = {name: [] for name in plans}
    for round_ in range(args.rounds):
        for name, modes in plans.items():
            set_plan(layers, own, modes)
            times[name].append(seconds(model, ids, 100 + round_))
    write(plans, times, measured, args.rounds, args.setup)


def write(plans, times, figures, rounds, setup: str) -> None:
    _, _, _, filename, title = SETUPS[setup]
    plain_bytes, plain_flops = figures["no checkpointing"]
    full_flops = figures["full checkpointing"][1] - plain_flops
    plain_s = statistics.median(times["no checkpointing"])
    full_over = statistics.median(times["full checkpointing"]) / plain_s - 1
    lines = [
        f"# {title}: the budget's plan against plans recomputing fewer FLOPs",
        "",
        f"Generated by `GCPATCH=1 python benchmarks/dropout_plans.py --rounds {rounds}"
        f"{'' if setup == 'dropout' else ' --setup ' + setup}` (torch "
        f"{torch.__version__}, {torch.get_num_threads()} thread(s), CPU). See the script's "
        "docstring. bytes: the forward's held bytes / no checkpointing's; FLOPs: matmul and "
        "attention FLOPs recomputed / full checkpointing's; time: median step thread time / no checkpointing's; "
        "overhead: its excess / full checkpointing's. layers: `W` whole, `K` keeping the matmuls, "
        "`A` (where any) keeping the attention output, `P` plain, `F` (where any) plain with the "
        "MLP alone checkpointed.",
        "",
        "| plan | layers | bytes | FLOPs | time | overhead |",
        "|---|---|---|---|---|---|",
    ]
    for name, modes in plans.items():
        nbytes, flops = figures[name]
        over = statistics.median(times[name]) / plain_s - 1
        letters = (
            ("full", "W"),
            ("keep-matmuls", "K"),
            ("keep-attention", "A"),
            ("plain", "P"),
            ("feed-forward", "F"),
        )
        counted = " ".join(
            f"{modes.count(m)}{letter}"
            for m, letter in letters
            if m not in ("feed-forward", "keep-attention") or m in modes
        )
        lines.append(
            f"| {name} | {counted} | {nbytes / plain_bytes:.3f} | "
            f"{(flops - plain_flops) / full_flops:.3f} | {over + 1:.3f} | "
            f"{over / full_over:.2f} |"
        )
    (HERE / filename).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
