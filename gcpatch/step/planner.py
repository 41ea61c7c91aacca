"""GCPATCH_MEMORY_BUDGET at work: probe a model's first training step, choose the cheapest
checkpointing that meets the budget, apply it from the next training forward on, and say so in
one line.

The first training step runs with checkpointing as enabled (every layer: the floor of the budget),
and the probe reads its own forward and backward (gcpatch/step/probe.py): nothing of the user's
runs more often than plain checkpointing runs it, no process-wide state is touched, no rank waits
for another (each plans from its own step, for the shapes it sees: gcpatch/step/shapes.py). FSDP2
and ZeRO-3 are probed alike: the engines' gathers run inside the layers as they would anyway.

A per-layer plan needs a per-layer switch: transformers' GradientCheckpointingLayer (4.52+) reads
each layer's own `gradient_checkpointing` flag. Families whose model loop checkpoints the layers
have none, and keep full checkpointing with the reason said. With GCPATCH_VERIFY=1 the first step
with the plan in place is counted too, and a line says what it really held.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

from gcpatch import apply as apply_mod
from gcpatch import budget as budget_mod
from gcpatch import context, headline, record, settings
from gcpatch.facts import checkpoint_layers, checkpoint_site
from gcpatch.ranks import rank
from gcpatch.step import cost_model, plan_lines, shapes
from gcpatch.step.batch import shape as batch_shape
from gcpatch.step.held import Held
from gcpatch.step.levers import feed_forward
from gcpatch.step.levers.offload import accelerator_of
from gcpatch.step.outcome import Outcome, plan_dict
from gcpatch.step.probe import Probe
from gcpatch.step.shapes import ShapePlans, available_bytes

log = logging.getLogger("gcpatch")
TOLERANCE = 0.05  # a step is expected within 5% of its plan's budget


def start(model: Any, args: tuple, kwargs: dict, chosen: budget_mod.Budget) -> Probe | Outcome:
    """At the first training forward: the probe on its layers, or why the budget is skipped."""
    torch = sys.modules["torch"]
    layers = _layers(model)
    why = _unplannable(model, layers, chosen)
    found = batch_shape(torch, args, kwargs)
    if why is None and found is None:
        why = "no tensor input with a batch dimension"
    if why is not None:
        return Outcome.skip(why)
    blocks = [feed_forward.block(m) for m in layers]
    probe = Probe(layers, blocks, found, accelerator_of(model) is not None)
    try:
        probe.start()
    except Exception as exc:  # noqa: BLE001 (fail open: full checkpointing, as decided)
        probe.finish()
        return Outcome.skip(f"the step could not be probed ({type(exc).__name__}: {exc})")
    return probe


def plan(
    model: Any, module: Any, args: tuple, kwargs: dict, chosen: budget_mod.Budget, probe: Probe
) -> Outcome | None:
    """At the next training forward: the cost model from the probed step, this step's plan
    applied and the plans by shape installed on `module`; reported. None where the probed step
    showed too little (a reentrant layer's saves are read in a backward that did not run)."""
    torch = sys.modules["torch"]
    name = context.name(model)
    try:
        facts = probe.finish()
        if probe.failed:
            outcome = Outcome.skip(f"the step could not be probed ({probe.failed})")
        elif not facts.complete:
            return None
        else:
            layers = probe.layers
            funcs = [vars(m).get("_gradient_checkpointing_func") for m in layers]
            costs = cost_model.build(
                facts, layers, funcs, settings.budget_levers(), _untrained(model, layers)
            )
            plans = ShapePlans(model, layers, costs, chosen, name)
            rows, tokens = batch_shape(torch, args, kwargs) or facts.shape
            available = available_bytes(model, chosen) if chosen.auto else None
            first = plans.agreed(plans.plan_for(rows, tokens, available), rows, tokens)
            plans.apply(first)
            plans.install(module)
            outcome = Outcome(plan=first, shape=(rows, tokens), costs=costs)
    except Exception as exc:  # noqa: BLE001 (fail open: full checkpointing, as decided)
        outcome = Outcome.skip(f"planning failed ({type(exc).__name__}: {exc})")
    report(name, chosen, outcome)
    return outcome


def _layers(model: Any) -> list:
    return [
        m for m in checkpoint_layers(model) if getattr(m, "gradient_checkpointing", False) is True
    ]


def _unplannable(model: Any, layers: list, chosen: budget_mod.Budget) -> str | None:
    if not layers:
        return "no layer has checkpointing on"
    if chosen.auto and available_bytes(model, chosen) is None:
        return (
            "auto has nothing to measure here: the model is on no accelerator (state a"
            " capacity as auto:<size>, e.g. auto:24GiB)"
        )
    if checkpoint_site(layers) == "loop":
        return (
            f"{type(model).__name__} checkpoints its layers from the model's own loop (a family"
            " older than transformers' GradientCheckpointingLayer), which has no per-layer"
            " switch"
        )
    if not any(p.requires_grad for p in model.parameters()):
        return "no trainable parameters"
    return None


def _untrained(model: Any, layers: list) -> int:
    """How many layers from the first hold nothing in the user's own job without checkpointing:
    where only gcpatch's input-grads hook (R2) gives their input a graph, the leading layers
    without a trainable parameter (nor one in the embeddings before them)."""
    if apply_mod.input_hooks_installed(model) == 0:
        return 0
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    if embeddings is not None and any(p.requires_grad for p in embeddings.parameters()):
        return 0
    count = 0
    for layer in layers:
        if any(p.requires_grad for p in layer.parameters()):
            break
        count += 1
    return count


def report(name: str, chosen: budget_mod.Budget, outcome: Outcome) -> None:
    cfg = settings.read()
    text = f"gcpatch: rank {rank()} budget {name}: {plan_lines.line(chosen, outcome, name)}"
    below = outcome.plan is not None and outcome.plan.below_floor
    level = logging.WARNING if outcome.skipped or below else logging.INFO
    log.log(level, "%s", headline.wrap(text))
    record.event(
        {
            "stage": "budget",
            "model": name,
            "line": text,
            "details": plan_lines.details(outcome),
            "budget": {"setting": chosen.text, **outcome.to_record()},
        },
        cfg.record_dir,
    )


class Confirmation:
    """GCPATCH_VERIFY=1: counts what the first forward with the plan in place really holds, and
    says it in one line (first_step starts it before that forward and ends it after)."""

    def __init__(self, name: str, outcome: Outcome, model: Any = None) -> None:
        self.name, self.outcome = name, outcome
        self.plans = shapes.of(model) if model is not None else None
        # on an accelerator its memory alone: offloaded inputs wait in host memory
        self.held = Held(device_only=model is not None and accelerator_of(model) is not None)

    def __enter__(self) -> Confirmation:
        self.held.__enter__()
        return self

    def done(self, output: Any) -> None:
        cfg = settings.read()
        try:
            self.held.__exit__(None, None, None)
            total = self.held.total(returned=output)
        except Exception as exc:  # noqa: BLE001 (fail open: the step goes on unmeasured)
            log.error(
                "gcpatch: rank %d budget %s: the real step could not be measured (%s: %s)",
                rank(),
                self.name,
                type(exc).__name__,
                exc,
            )
            return
        # the plan this step's own shape picked (the pre-hook ran before this forward)
        last = self.plans.last if self.plans is not None else None
        plan = plan_dict(last) if last is not None else plan_dict(self.outcome.plan)
        ok = total <= max(plan["limit_bytes"], plan["floor_bytes"]) * (1 + TOLERANCE)
        size = budget_mod.size
        line = (
            f"gcpatch: rank {rank()} budget {self.name}: verified on the real step: activations "
            f"{size(total)} held (planned {size(plan['planned_bytes'])}, budget "
            f"{size(plan['limit_bytes'])}){'' if ok else ': OVER the budget'}"
        )
        log.log(logging.INFO if ok else logging.WARNING, "%s", headline.wrap(line))
        record.event(
            {
                "stage": "budget-verify",
                "model": self.name,
                "line": line,
                "budget_verify": {"held_bytes": total, "within": ok, **plan},
            },
            cfg.record_dir,
        )

    def abandon(self) -> None:
        with contextlib.suppress(Exception):
            self.held.__exit__(None, None, None)
