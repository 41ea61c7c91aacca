"""GCPATCH_MEMORY_BUDGET at work: measure a model's layers, choose the cheapest checkpointing that
meets the budget, switch the other layers' checkpointing off, and say so in one line.

It runs once the user's first training forward has returned (gcpatch/step/first_step.py), before
that step's backward: the first step itself runs with checkpointing as enabled (every layer, the
floor of the budget), so nothing of the user's runs twice before their own forward and an exception
of their own surfaces from their own call. The measuring passes run on a slice of that batch, in
forward passes only, invisibly (gcpatch/step/invisible.py): RNG, buffers and flags as they were,
the user's own hooks off. The plan applies from the next training forward on.

A per-layer plan needs a per-layer switch: transformers' GradientCheckpointingLayer (4.52+) reads
each layer's own `gradient_checkpointing` flag. Families whose model loop checkpoints the layers
have none, and keep full checkpointing with the reason said. Under DDP every rank runs rank 0's
plan, handed over through the process group's store (times differ per rank, so a plan measured on
each could differ); FSDP and ZeRO-3 keep full checkpointing: a measuring forward would run their
collectives on one rank only. With GCPATCH_VERIFY=1 the next step, the first with the plan in
place, is measured too, and a line says what it really held.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import weakref
from datetime import timedelta
from typing import Any, Iterator

from gcpatch import budget as budget_mod
from gcpatch import lifetime, record, settings
from gcpatch.facts import checkpoint_layers, checkpoint_site
from gcpatch.ranks import default_store, rank
from gcpatch.step import invisible, layer_costs, solver
from gcpatch.step.batch import batch_size, first_rows
from gcpatch.step.held import Held

log = logging.getLogger("gcpatch")
TOLERANCE = (
    0.05  # the plan is expected within 5% of its budget: bytes are extrapolated from a slice
)
DEFAULT_TIMEOUT_S = 1800.0  # as long as DDP's own collectives wait by default
_ABSENT = object()  # a layer without its own `gradient_checkpointing` (the class default applies)

# What a model was planned to (a re-enable, e.g. the Trainer's `train()`, gets it back at once),
# and how many plans each model class handed over so far (the same count on every rank).
_plans: weakref.WeakKeyDictionary[Any, list[bool]] = weakref.WeakKeyDictionary()
_shared: dict[str, int] = {}


@lifetime.activation
def reset() -> None:
    """Forget every plan (a re-activation starts as a fresh process)."""
    _plans.clear()
    _shared.clear()


def restore(model: Any) -> bool:
    """A model planned already, enabled again (the framework's enable has just switched every layer
    on): its plan back at once. Whether it had one."""
    flags = _plans.get(model)
    if flags is None:
        return False
    apply(model, flags)
    return True


def plan(model: Any, module: Any, args: tuple, kwargs: dict, chosen: budget_mod.Budget) -> dict:
    """Measure, solve and apply the plan for `model` from this forward's batch (`module`: the model
    or the base model whose forward was entered); report it. Returns the outcome."""
    torch = sys.modules["torch"]
    cfg = settings.read()
    name = type(model).__name__
    try:
        outcome = _plan(torch, model, module, args, kwargs, chosen)
    except Exception as exc:  # noqa: BLE001 (fail open: full checkpointing, as decided)
        outcome = {"skipped": f"planning failed ({type(exc).__name__}: {exc})"}
    if "flags" in outcome:
        _plans[model] = outcome["flags"]
        apply(model, outcome["flags"])
    _report(name, chosen, outcome, cfg)
    return outcome


def _plan(
    torch: Any, model: Any, module: Any, args: tuple, kwargs: dict, chosen: budget_mod.Budget
) -> dict:
    layers = [
        m for m in checkpoint_layers(model) if getattr(m, "gradient_checkpointing", False) is True
    ]
    if not layers:
        return {"skipped": "no layer has checkpointing on"}
    if checkpoint_site(layers) == "loop":
        return {
            "skipped": (
                f"{type(model).__name__} checkpoints its layers from the model's own loop (a family"
                " older than transformers' GradientCheckpointingLayer), which has no per-layer"
                " switch"
            )
        }
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    reason = invisible.unsupported(torch, module, trainable, kwargs)
    # the optimizer-in-backward reason does not hold here: the measuring passes run no backward
    if reason and not reason.startswith("parameters carry post-accumulate-grad hooks"):
        return {"skipped": reason}
    batch = batch_size(torch, args, kwargs)
    if batch is None:
        return {"skipped": "no tensor input with a batch dimension"}
    dist = _distributed()
    if dist is not None and dist.get_rank() != 0:
        return _from_rank0(dist, type(model).__name__)
    try:
        outcome = _measure_and_solve(torch, module, layers, args, kwargs, batch, chosen)
    except Exception as exc:  # noqa: BLE001 (published below, so no rank waits for nothing)
        outcome = {"skipped": f"measuring failed ({type(exc).__name__}: {exc})"}
    if dist is not None:
        _publish(dist, type(model).__name__, outcome)
    return outcome


def _measure_and_solve(
    torch: Any,
    module: Any,
    layers: list,
    args: tuple,
    kwargs: dict,
    batch: int,
    chosen: budget_mod.Budget,
) -> dict:
    def run(rows: int) -> Any:
        s_args, s_kwargs = first_rows(torch, (tuple(args), dict(kwargs)), batch, min(rows, batch))
        return module(*s_args, **s_kwargs)

    with invisible.gcpatch_pass(torch, module), _all_plain(layers):
        kinds = [type(m).__name__ for m in layers]
        measured = layer_costs.measure(module, layers, run, batch, kinds)
    found = solver.solve(measured.layers, measured.outside, chosen.limit(measured.plain_total))
    return {
        "flags": found.checkpoint,
        "plan": _plan_dict(found),
        "measured": {
            "rows": measured.rows,
            "batch": batch,
            "seconds": measured.seconds,
            "outside_bytes": measured.outside,
            "layers": [
                {
                    "plain_bytes": c.plain,
                    "checkpointed_bytes": c.checkpointed,
                    "recompute_s": c.seconds,
                }
                for c in measured.layers
            ],
        },
    }


@contextlib.contextmanager
def _all_plain(layers: list) -> Iterator[None]:
    """Every layer plain for the measuring forwards; their own flags back afterwards."""
    flags = [(m, vars(m).get("gradient_checkpointing", _ABSENT)) for m in layers]
    try:
        for m, _ in flags:
            m.gradient_checkpointing = False
        yield
    finally:
        for m, old in flags:
            if old is _ABSENT:
                vars(m).pop("gradient_checkpointing", None)
            else:
                m.gradient_checkpointing = old


def _plan_dict(found: solver.Plan) -> dict:
    return {
        "checkpointed": found.count,
        "layers": len(found.checkpoint),
        "limit_bytes": found.limit,
        "plain_bytes": found.plain_total,
        "floor_bytes": found.floor,
        "planned_bytes": found.total,
        "recompute_s": found.recompute_s,
        "full_recompute_s": found.full_recompute_s,
        "every_n_layers": found.every_n_layers(),
        "below_floor": found.below_floor,
        "exact": found.exact,
    }


def apply(model: Any, flags: list[bool]) -> None:
    layers = [
        m for m in checkpoint_layers(model) if getattr(m, "gradient_checkpointing", False) is True
    ]
    if len(layers) != len(
        flags
    ):  # the layers changed since the plan: full checkpointing, as decided
        log.warning(
            "gcpatch: memory budget: %s has %d checkpointed layers, the plan was made for %d; "
            "the plan is not applied",
            type(model).__name__,
            len(layers),
            len(flags),
        )
        return
    for layer, flag in zip(layers, flags):
        if not flag:
            layer.gradient_checkpointing = False


def _report(name: str, chosen: budget_mod.Budget, outcome: dict, cfg: settings.Settings) -> None:
    line = f"gcpatch: rank {rank()} budget {name}: {_line(chosen, outcome)}"
    below = "plan" in outcome and outcome["plan"]["below_floor"]
    level = logging.WARNING if "skipped" in outcome or below else logging.INFO
    log.log(level, "%s", line)
    record.event(
        {
            "stage": "budget",
            "model": name,
            "line": line,
            "details": _details(outcome),
            "budget": {"setting": chosen.text, **outcome},
        },
        cfg.record_dir,
    )


def _line(chosen: budget_mod.Budget, outcome: dict) -> str:
    size = budget_mod.size
    if "skipped" in outcome:
        return (
            f"memory budget {chosen.text} not applied, every checkpointed layer kept:"
            f" {outcome['skipped']}"
        )
    plan = outcome["plan"]
    plain = plan["plain_bytes"] or 1.0
    source = " (rank 0's plan)" if outcome.get("from_rank0") else ""
    if plan["below_floor"]:
        return (
            f"memory budget {chosen.text} ({size(plan['limit_bytes'])}) is below the floor of full"
            f" checkpointing, {size(plan['floor_bytes'])} ({plan['floor_bytes'] / plain:.0%} of"
            f" {size(plan['plain_bytes'])} without checkpointing): all {plan['layers']} layers"
            f" checkpointed{source}"
        )
    every = (
        f", every_n_layers={plan['every_n_layers']}"
        if plan["every_n_layers"] and plan["checkpointed"]
        else ""
    )
    full = plan["full_recompute_s"] or 1.0
    return (
        f"memory budget {chosen.text} ({size(plan['limit_bytes'])}): {plan['checkpointed']} of"
        f" {plan['layers']} layers checkpointed{every}{source}; activations"
        f" {size(plan['planned_bytes'])}, {plan['planned_bytes'] / plain:.0%} of"
        f" {size(plan['plain_bytes'])} without checkpointing (saves"
        f" {1 - plan['planned_bytes'] / plain:.0%}; full checkpointing"
        f" {plan['floor_bytes'] / plain:.0%}); expected recompute"
        f" {plan['recompute_s'] / full:.0%} of full checkpointing's"
    )


def _details(outcome: dict) -> list[str]:
    measured = outcome.get("measured")
    if not measured:
        return []
    flags = outcome.get("flags", [])
    size = budget_mod.size
    out = [
        f"measured on {'/'.join(map(str, measured['rows']))} of {measured['batch']} rows in "
        f"{measured['seconds']:.3g} s, extrapolated to the batch; outside the layers "
        f"{size(measured['outside_bytes'])}"
    ]
    for i, layer in enumerate(measured["layers"]):
        out.append(
            f"layer {i}: {'checkpointed' if i < len(flags) and flags[i] else 'plain'}; holds "
            f"{size(layer['plain_bytes'])} plain, {size(layer['checkpointed_bytes'])} "
            f"checkpointed; recompute {layer['recompute_s'] * 1e3:.3g} ms"
        )
    return out


class Confirmation:
    """GCPATCH_VERIFY=1: counts what the first forward with the plan in place really holds, and
    says it in one line (first_step starts it before that forward and ends it after)."""

    def __init__(self, name: str, outcome: dict) -> None:
        self.name, self.outcome = name, outcome
        self.held = Held()

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
        plan = self.outcome["plan"]
        ok = total <= max(plan["limit_bytes"], plan["floor_bytes"]) * (1 + TOLERANCE)
        size = budget_mod.size
        line = (
            f"gcpatch: rank {rank()} budget {self.name}: verified on the real step: activations "
            f"{size(total)} held (planned {size(plan['planned_bytes'])}, budget "
            f"{size(plan['limit_bytes'])}){'' if ok else ': OVER the budget'}"
        )
        log.log(logging.INFO if ok else logging.WARNING, "%s", line)
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


def _distributed() -> Any:
    dist = sys.modules.get("torch.distributed")
    if (
        dist is None
        or not dist.is_available()
        or not dist.is_initialized()
        or dist.get_world_size() < 2
    ):
        return None
    return dist


def _key(model_name: str) -> str:
    _shared[model_name] = count = _shared.get(model_name, 0) + 1
    return f"gcpatch/budget/{model_name}/{count}"


def _publish(dist: Any, model_name: str, outcome: dict) -> None:
    store = default_store(dist)
    if store is None:
        log.warning(
            "gcpatch: memory budget: no process-group store to hand rank 0's plan to the other"
            " ranks"
        )
        return
    store.set(_key(model_name), json.dumps(outcome))


def _from_rank0(dist: Any, model_name: str) -> dict:
    store = default_store(dist)
    if store is None:
        return {"skipped": "no process-group store to receive rank 0's plan through"}
    key = _key(model_name)
    try:
        timeout = min(float(store.timeout.total_seconds()), DEFAULT_TIMEOUT_S)
    except Exception:  # noqa: BLE001 (a store without a readable timeout)
        timeout = DEFAULT_TIMEOUT_S
    try:
        store.wait([key], timedelta(seconds=timeout))
        outcome = json.loads(store.get(key))
    except Exception as exc:  # noqa: BLE001
        return {
            "skipped": (
                f"rank 0's plan did not arrive within {timeout:g} s ({type(exc).__name__}: {exc})"
            )
        }
    if "flags" in outcome:
        outcome["from_rank0"] = True
    return outcome
