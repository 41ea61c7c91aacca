"""GCPATCH_MEMORY_BUDGET at work: at a model's first training forward, measure its layers, choose
the cheapest checkpointing that meets the budget, switch the other layers' checkpointing off, and
say so in one line.

It runs where verify runs (the first grad-enabled forward, before it), on a slice of that batch,
in forward passes only: no gradient is computed, the RNG streams are forked and rewound and the
buffers put back, so the user's step runs exactly as if the plan had been there from the start.
A per-layer plan needs a per-layer switch: transformers' GradientCheckpointingLayer (4.52+)
reads each layer's own `gradient_checkpointing` flag. Families whose model loop checkpoints the
layers have none, and keep full checkpointing with the reason said. Under DDP every rank runs
rank 0's plan, handed over through the process group's store (times differ per rank, so a plan
measured on each could differ); FSDP and ZeRO-3 keep full checkpointing: a measuring forward
would run their collectives on one rank only. With GCPATCH_VERIFY=1 the user's own first step is
measured too, and the line says what it really held.
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
from gcpatch import record, settings, verify
from gcpatch.facts import checkpoint_layers, checkpoint_site
from gcpatch.ranks import rank

log = logging.getLogger("gcpatch")
TOLERANCE = (
    0.05  # the plan is expected within 5% of its budget: bytes are extrapolated from a slice
)
DEFAULT_TIMEOUT_S = 1800.0  # as long as DDP's own collectives wait by default

_armed: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()
_plans: "weakref.WeakKeyDictionary[Any, list[bool]]" = weakref.WeakKeyDictionary()
_shared: dict[
    str, int
] = {}  # model class -> plans handed over so far (the same count on every rank)
_measuring = False
_ABSENT = object()  # a layer without its own `gradient_checkpointing` (the class default applies)


def arm(model: Any, chosen: budget_mod.Budget) -> None:
    """Plan `model` at its first grad-enabled forward. A model planned already (enabled again,
    e.g. by the Trainer's `train()`) gets its plan back at once: the framework's enable has just
    switched every layer on."""
    try:
        flags = _plans.get(model)
        if flags is not None:
            _apply(model, flags)
            return
        for handle in _armed.pop(model, ()):
            handle.remove()
        _armed[model] = [
            m.register_forward_pre_hook(_once(weakref.ref(model), chosen), with_kwargs=True)
            for m in _entered(model)
        ]
    except Exception as exc:  # noqa: BLE001 (fail open)
        log.error(
            "gcpatch: memory budget not armed for %s (%s: %s); checkpointing stays as decided",
            type(model).__name__,
            type(exc).__name__,
            exc,
        )


def _entered(model: Any) -> list[Any]:
    """The modules whose pre-hooks see the model's first forward: the model, and its base model,
    since peft < 0.18 enters the model's `forward` without a module call (as verify.arm)."""
    base = getattr(model, "base_model", None)
    if base is None or base is model or not hasattr(base, "register_forward_pre_hook"):
        return [model]
    return [model, base]


def _once(outer: Any, chosen: budget_mod.Budget) -> Any:
    def first_forward(module: Any, args: tuple, kwargs: dict) -> None:
        target = outer()
        if target is not None:
            _on_first_forward(target, module, args, kwargs, chosen)

    return first_forward


def _on_first_forward(
    model: Any, module: Any, args: tuple, kwargs: dict, chosen: budget_mod.Budget
) -> None:
    torch = sys.modules["torch"]
    if _measuring or not torch.is_grad_enabled():
        return
    for handle in _armed.pop(model, ()):
        handle.remove()
    cfg = settings.read()
    name = type(model).__name__
    try:
        outcome = _plan(torch, model, module, args, kwargs, chosen)
    except Exception as exc:  # noqa: BLE001 (fail open: full checkpointing, as decided)
        outcome = {"skipped": f"planning failed ({type(exc).__name__}: {exc})"}
    if "flags" in outcome:
        _plans[model] = outcome["flags"]
        _apply(model, outcome["flags"])
    _report(name, chosen, outcome, cfg)
    if "flags" in outcome and cfg.verify:
        _confirm_on_this_step(module, name, outcome, cfg)


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
    reason = verify._unsupported(torch, module, trainable, kwargs)
    # verify's reasons, but for the optimizer-in-backward one: the measuring passes run no backward
    if reason and not reason.startswith("parameters carry post-accumulate-grad hooks"):
        return {"skipped": reason}
    batch = verify._batch_size(torch, args, kwargs)
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
    from gcpatch import layer_costs

    def run(rows: int) -> Any:
        s_args, s_kwargs = verify._slice(
            torch, (tuple(args), dict(kwargs)), batch, min(rows, batch)
        )
        return module(*s_args, **s_kwargs)

    with _invisible(torch, module, layers):
        measured = layer_costs.measure(
            module, layers, run, batch, [type(m).__name__ for m in layers]
        )
    plan = budget_mod.solve(measured.layers, measured.outside, chosen.limit(measured.plain_total))
    return {
        "flags": plan.checkpoint,
        "plan": _plan_dict(plan),
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


def _plan_dict(plan: budget_mod.Plan) -> dict:
    return {
        "checkpointed": plan.count,
        "layers": len(plan.checkpoint),
        "limit_bytes": plan.limit,
        "plain_bytes": plan.plain_total,
        "floor_bytes": plan.floor,
        "planned_bytes": plan.total,
        "recompute_s": plan.recompute_s,
        "full_recompute_s": plan.full_recompute_s,
        "every_n_layers": plan.every_n_layers(),
        "below_floor": plan.below_floor,
        "exact": plan.exact,
    }


@contextlib.contextmanager
def _invisible(torch: Any, module: Any, layers: list) -> Iterator[None]:
    """Every layer plain, verify's and this module's hooks quiet, the RNG streams and buffers
    as they were, for the measuring forwards."""
    global _measuring
    flags = [(m, vars(m).get("gradient_checkpointing", _ABSENT)) for m in layers]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted(
        {p.device.index or 0 for p in module.parameters() if p.device.type not in ("cpu", "meta")}
    )
    device_type = next(
        (p.device.type for p in module.parameters() if p.device.type not in ("cpu", "meta")), "cuda"
    )
    checking, _measuring, verify._checking = verify._checking, True, True
    try:
        with (
            torch.random.fork_rng(devices=devices, device_type=device_type),
            verify._python_rng_kept(),
        ):
            for m, _ in flags:
                m.gradient_checkpointing = False
            yield
    finally:
        _measuring, verify._checking = False, checking
        for m, old in flags:
            if old is _ABSENT:
                vars(m).pop("gradient_checkpointing", None)
            else:
                m.gradient_checkpointing = old
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _apply(model: Any, flags: list[bool]) -> None:
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
    level = (
        logging.WARNING if "skipped" in outcome or outcome["plan"]["below_floor"] else logging.INFO
    )
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
        f" {plan['floor_bytes'] / plain:.0%}); expected recompute {plan['recompute_s'] / full:.0%}"
        " of full checkpointing's"
    )


def _details(outcome: dict) -> list[str]:
    measured = outcome.get("measured")
    if not measured:
        return []
    flags = outcome.get("flags", [])
    out = [
        f"measured on {'/'.join(map(str, measured['rows']))} of {measured['batch']} rows in "
        f"{measured['seconds']:.3g} s, extrapolated to the batch; outside the layers "
        f"{budget_mod.size(measured['outside_bytes'])}"
    ]
    for i, layer in enumerate(measured["layers"]):
        out.append(
            f"layer {i}: {'checkpointed' if i < len(flags) and flags[i] else 'plain'}; holds"
            f" {budget_mod.size(layer['plain_bytes'])} plain,"
            f" {budget_mod.size(layer['checkpointed_bytes'])} checkpointed; recompute"
            f" {layer['recompute_s'] * 1e3:.3g} ms"
        )
    return out


def _confirm_on_this_step(module: Any, name: str, outcome: dict, cfg: settings.Settings) -> None:
    """GCPATCH_VERIFY=1: count what the user's own first forward holds, with the plan in place."""
    from gcpatch import layer_costs

    held = layer_costs.Held()
    held.__enter__()
    handle: list[Any] = []

    def done(mod: Any, args: Any, output: Any) -> None:
        if verify._checking:  # verify's own passes on this model, run from its pre-hook after ours
            return
        for h in handle:
            h.remove()
        try:
            held.__exit__(None, None, None)
            total = held.total(returned=output)
        except Exception as exc:  # noqa: BLE001
            log.error(
                "gcpatch: rank %d budget %s: the real step could not be measured (%s: %s)",
                rank(),
                name,
                type(exc).__name__,
                exc,
            )
            return
        plan = outcome["plan"]
        ok = total <= max(plan["limit_bytes"], plan["floor_bytes"]) * (1 + TOLERANCE)
        line = (
            f"gcpatch: rank {rank()} budget {name}: verified on the real step: activations"
            f" {budget_mod.size(total)} held (planned {budget_mod.size(plan['planned_bytes'])},"
            f" budget {budget_mod.size(plan['limit_bytes'])}){'' if ok else ': OVER the budget'}"
        )
        log.log(logging.INFO if ok else logging.WARNING, "%s", line)
        record.event(
            {
                "stage": "budget-verify",
                "model": name,
                "line": line,
                "budget_verify": {"held_bytes": total, "within": ok, **plan},
            },
            cfg.record_dir,
        )

    handle.append(module.register_forward_hook(done, always_call=True))


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
    from gcpatch.ranks import default_store

    store = default_store(dist)
    if store is None:
        log.warning(
            "gcpatch: memory budget: no process-group store to hand rank 0's plan to the other"
            " ranks"
        )
        return
    store.set(_key(model_name), json.dumps(outcome))


def _from_rank0(dist: Any, model_name: str) -> dict:
    from gcpatch.ranks import default_store

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
