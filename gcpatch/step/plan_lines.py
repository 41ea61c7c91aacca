"""What the budget says: its first plan in at most two terminal rows (what is checkpointed, what
it holds against the user's step without checkpointing, what it recomputes), and the record's
details behind it (`gcpatch explain -v`)."""

from __future__ import annotations

from gcpatch import budget as budget_mod
from gcpatch import headline
from gcpatch.step import levers
from gcpatch.step.outcome import Outcome
from gcpatch.step.solver import PLAIN, Plan


def levers_text(plan: Plan, brief: bool = False) -> str:
    """How a plan's line names the layers under a lever but whole: " (2 keeping their matmuls)",
    or "" (`brief`: " (2 matmuls kept)")."""
    counts = plan.counts()
    parts = [
        f"{counts[lever.name]} {lever.brief if brief else lever.says}"
        for lever in levers.every()
        if lever.name in counts
    ]
    return f" ({', '.join(parts)})" if parts else ""


def line(chosen: budget_mod.Budget, outcome: Outcome, prefix: str = "") -> str:
    """The plan in at most two terminal rows; each layer, lever and refusal is in the record's
    details."""
    if outcome.plan is None:
        return (
            f"memory budget {chosen.text} not applied, every checkpointed layer kept:"
            f" {outcome.skipped}"
        )
    plan = outcome.plan
    size = budget_mod.size
    plain = plan.baseline or 1.0
    rows, tokens = outcome.shape or (0, 0)
    source = f" at {rows} x {tokens} tokens" if rows else ""
    levered = sum(1 for mode in plan.modes if mode not in (PLAIN, levers.WHOLE.name))
    kept = (
        levers_text(plan),
        levers_text(plan, brief=True),
        f" ({levered} with a lever)" if levered else "",
    )
    probed = _probed_text(outcome)
    if plan.below_floor:
        head = (
            f"memory budget {chosen.text} ({size(plan.limit)}) is below the floor of full"
            f" checkpointing, {size(plan.floor)} ({plan.floor / plain:.0%} of"
            f" {size(plan.baseline)} without checkpointing): all {len(plan.modes)} layers"
            " checkpointed"
        )
        return _fit(prefix, head, [(kept, (2, 3)), ((source, ""), (0,)), (probed, (1,))])
    full = plan.full_recompute_s or 1.0
    every = plan.every_n_layers()
    every_text = f", every_n_layers={every}" if every and plan.count else ""
    head = f"memory budget {chosen.text}: {plan.count} of {len(plan.modes)} layers checkpointed"
    greedy = (
        ("", "", "")
        if plan.exact
        else (" (greedy: within one layer's recompute of the cheapest)", " (greedy)", "")
    )
    if not plan.exact and kept[2]:  # the shortest form says both in one bracket
        kept = (*kept[:2], kept[2].replace(")", ", greedy)"))
    figures = (
        f"; holds {size(plan.total)}, {plan.total / plain:.0%} of"
        f" {size(plan.baseline)} without checkpointing (full checkpointing"
        f" {plan.floor / plain:.0%}); recompute {plan.recompute_s / full:.0%} of full"
        " checkpointing's"
    )
    short = figures.replace(" without checkpointing (full checkpointing", " (full")
    # in the line's order; the number is when each gives way to its short form: the layer
    # pattern, the shape, the search's words, the figures', the probe's, the refusals', and
    # the levers' names last
    parts = [
        ((every_text, ""), (0,)),
        (kept, (5, 7)),
        (greedy if kept[2] else greedy[:2], (2, 7) if kept[2] else (2,)),
        ((source, ""), (1,)),
        ((figures, short.replace(" of full checkpointing's", " of full's")), (3,)),
        (refused_text(outcome), (6,)),
        (probed, (4,)),
    ]
    return _fit(prefix, head, parts)


def _fit(prefix: str, head: str, parts: list[tuple[tuple[str, ...], tuple[int, ...]]]) -> str:
    """`head`, then `parts` within two terminal rows. Each part is its forms, longest first, and
    the steps at which it gives way to the next."""
    steps = max((n for _, at in parts for n in at), default=-1) + 2
    for step in range(steps):
        text = head + "".join(forms[sum(n < step for n in at)] for forms, at in parts)
        if len(headline.wrap(f"gcpatch: rank 0 budget {prefix}: {text}").splitlines()) <= 2:
            break
    return text


def _probed_text(outcome: Outcome) -> tuple[str, str]:
    """Where the figures come from: the job's own first step, and in short."""
    if outcome.costs is None:
        return "", ""
    return "; measured on step 1", ""


def refused_text(outcome: Outcome) -> tuple[str, str]:
    """The levers the step showed a layer cannot run, by name, and in short (why: in the
    details): ("; keeping the matmuls refused on 4 of 8 layers", "; 1 lever refused")."""
    costs = outcome.costs
    if costs is None:
        return "", ""
    counts: dict[str, int] = {}
    for layer in costs.layers:
        for name, why in layer.refused.items():
            if why.startswith("refused: "):
                counts[name] = counts.get(name, 0) + 1
    full = "".join(
        f"; {levers.get(name).title if levers.get(name) else name} refused on {n} of"
        f" {len(costs.layers)} layers"
        for name, n in counts.items()
    )
    count = len(counts)
    return full, f"; {count} lever{'s' if count > 1 else ''} refused" if count else ""


def details(outcome: Outcome) -> list[str]:
    """One line per layer and per lever, for the record (`gcpatch explain -v`)."""
    costs = outcome.costs
    if costs is None:
        return []
    size = budget_mod.size
    flags = outcome.plan.checkpoint if outcome.plan is not None else []
    rows, tokens = costs.shape
    out = [
        f"measured on the first training step ({rows} x {tokens} tokens), from its own forward"
        f" and backward; outside the layers {size(costs.outside.total)}"
    ]
    for i, layer in enumerate(costs.layers):
        held = ", ".join(f"{size(b.total)} {name}" for name, b in layer.held.items())
        shares = ", ".join(
            f"{name} {share:.2f} of whole (FLOPs {layer.counted.get(name, 0.0):.2f})"
            for name, share in layer.shares.items()
            if name != levers.WHOLE.name
        )
        refused = "; ".join(f"{name}: {why}" for name, why in layer.refused.items())
        out.append(
            f"layer {i}: {'checkpointed' if i < len(flags) and flags[i] else 'plain'}; holds"
            f" {held}; recompute {layer.seconds * 1e3:.3g} ms"
            + (f"; {shares}" if shares else "")
            + (f"; not offered: {refused}" if refused else "")
        )
    return out
