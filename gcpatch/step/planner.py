"""GCPATCH_MEMORY_BUDGET at work: measure a model's layers, choose the cheapest checkpointing that
meets the budget, switch the other layers' checkpointing off, and say so in one line.

It runs once the user's first training forward has returned (gcpatch/step/first_step.py), before
that step's backward: the first step itself runs with checkpointing as enabled (every layer, the
floor of the budget), so nothing of the user's runs twice before their own forward and an exception
of their own surfaces from their own call. The measuring passes run on a slice of that batch, in
forward passes only, invisibly (gcpatch/step/invisible.py): RNG, buffers and flags as they were,
the user's own hooks off. They fit a cost model of the batch shape (rows and tokens:
gcpatch/step/cost_model.py), and from the next training forward on each step's own shape picks its
plan from it (gcpatch/step/shapes.py): the budget holds on every step, not only on the first shape.

A per-layer plan needs a per-layer switch: transformers' GradientCheckpointingLayer (4.52+) reads
each layer's own `gradient_checkpointing` flag. Families whose model loop checkpoints the layers
have none, and keep full checkpointing with the reason said. Under DDP every rank plans by rank 0's
cost model, handed over through the process group's store (times differ per rank, so models measured
on each could differ), each for the shape it sees; FSDP and ZeRO-3 keep full checkpointing: a
measuring forward would run their
collectives on one rank only. With GCPATCH_VERIFY=1 the next step, the first with the plan in
place, is measured too, and a line says what it really held.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from datetime import timedelta
from typing import Any, Iterator

from gcpatch import budget as budget_mod
from gcpatch import context, headline, lifetime, record, settings
from gcpatch.facts import checkpoint_layers, checkpoint_site
from gcpatch.ranks import default_store, rank
from gcpatch.step import invisible, layer_costs, media, offload, selective, shapes, solver
from gcpatch.step.batch import first_rows, first_tokens, leaf
from gcpatch.step.batch import shape as batch_shape
from gcpatch.step.cost_model import CostModel
from gcpatch.step.held import Held
from gcpatch.step.shapes import ShapePlans, available_bytes, plan_dict

log = logging.getLogger("gcpatch")
TOLERANCE = (
    0.05  # the plan is expected within 5% of its budget: bytes are extrapolated from a slice
)
DEFAULT_TIMEOUT_S = 1800.0  # as long as DDP's own collectives wait by default
_ABSENT = object()  # a layer without its own `gradient_checkpointing` (the class default applies)

# How many plans each model class handed over so far (the same on every rank).
_shared: dict[str, int] = {}


@lifetime.activation
def reset() -> None:
    """Forget which runs shared rank 0's cost model (a re-activation starts as a fresh process)."""
    _shared.clear()


def plan(model: Any, module: Any, args: tuple, kwargs: dict, chosen: budget_mod.Budget) -> dict:
    """Measure, solve and apply the plan for `model` from this forward's batch (`module`: the model
    or the base model whose forward was entered); report it. Returns the outcome."""
    torch = sys.modules["torch"]
    cfg = settings.read()
    name = context.name(model)
    try:
        outcome = _plan(torch, model, module, args, kwargs, chosen)
        if "cost_model" in outcome:
            outcome = _first_plan(torch, model, module, args, kwargs, chosen, name, outcome)
    except Exception as exc:  # noqa: BLE001 (fail open: full checkpointing, as decided)
        outcome = {"skipped": f"planning failed ({type(exc).__name__}: {exc})"}
    _report(name, chosen, outcome, cfg)
    return outcome


def _first_plan(
    torch: Any,
    model: Any,
    module: Any,
    args: tuple,
    kwargs: dict,
    chosen: budget_mod.Budget,
    name: str,
    outcome: dict,
) -> dict:
    """The plans by shape, installed on the module this step entered; this batch's plan applied
    (it holds from the next training forward on, whose own shape then picks)."""
    layers = _layers(model)
    costs = CostModel.from_dict(outcome["cost_model"])
    if len(costs.plain) != len(layers):
        return {"skipped": f"the plan has {len(costs.plain)} layers, the model {len(layers)}"}
    plans = ShapePlans(model, layers, costs, chosen, name)
    rows, tokens = batch_shape(torch, args, kwargs) or (1, 1)
    available = available_bytes(model, chosen) if chosen.auto else None
    first = plans.plan_for(rows, tokens, available)
    plans.apply(first)
    plans.install(module)
    return {**outcome, "flags": first.checkpoint, "plan": plan_dict(first), "shape": [rows, tokens]}


def _layers(model: Any) -> list:
    return [
        m for m in checkpoint_layers(model) if getattr(m, "gradient_checkpointing", False) is True
    ]


def _plan(
    torch: Any, model: Any, module: Any, args: tuple, kwargs: dict, chosen: budget_mod.Budget
) -> dict:
    layers = _layers(model)
    if not layers:
        return {"skipped": "no layer has checkpointing on"}
    if chosen.auto and available_bytes(model, chosen) is None:
        return {
            "skipped": (
                "auto has nothing to measure here: the model is on no accelerator (state a"
                " capacity as auto:<size>, e.g. auto:24GiB)"
            )
        }
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
    found = batch_shape(torch, args, kwargs)
    if found is None:
        return {"skipped": "no tensor input with a batch dimension"}
    dist = _distributed()
    if dist is not None and dist.get_rank() != 0:
        return _from_rank0(dist, type(model).__name__)
    try:
        outcome = _measure(torch, module, layers, args, kwargs, found)
    except Exception as exc:  # noqa: BLE001 (published below, so no rank waits for nothing)
        outcome = {"skipped": f"measuring failed ({type(exc).__name__}: {exc})"}
    if dist is not None:
        _publish(dist, type(model).__name__, outcome)
    return outcome


def _measure(
    torch: Any, module: Any, layers: list, args: tuple, kwargs: dict, found: tuple[int, int]
) -> dict:
    """The cost model, from forwards on 1 and 2 rows at the batch's token count and half of it
    (tokens only where the batch is a token sequence and its truncation runs); images flattened
    across the rows go with the rows they stand in (gcpatch/step/media.py). A batch whose first row
    still does not run alone is measured whole where it has two rows, which holds no more than the
    two-row forward would, and taken as proportional to its rows."""
    batch, tokens = found
    config = getattr(module, "config", None)

    def run(rows: int, length: int) -> Any:
        rows = min(rows, batch)
        flattened = media.first_rows(torch, kwargs, rows, config) if rows < batch else {}
        rest = {k: v for k, v in kwargs.items() if k not in flattened}
        s_args, s_kwargs = first_rows(torch, (tuple(args), rest), batch, rows)
        s_kwargs.update({k: v if v is None else leaf(v, v) for k, v in flattened.items()})
        if length != tokens:
            s_args, s_kwargs = first_tokens(torch, (s_args, s_kwargs), tokens, length)
        return lambda: module(*s_args, **s_kwargs)

    kinds = [type(m).__name__ for m in layers]
    lengths = [tokens // 2, tokens] if tokens >= 4 else [tokens]
    levers = settings.budget_levers()
    # what to measure, from the most to the least: rows and tokens, rows alone, the batch whole
    # (two rows: no more than the two-row forward holds); each note says what the next one lost
    tries: list[tuple[list[int], list[int] | None, str]] = [(lengths, None, "")]
    if len(lengths) > 1:
        tries.append(([tokens], None, "tokens not measured"))
    if batch == 2:
        lost = "rows and tokens" if len(lengths) > 1 else "rows"
        tries.append(([tokens], [batch], f"{lost} not measured"))
    note = ""
    with invisible.gcpatch_pass(torch, module), _all_plain(layers):
        for i, (counts, rows, _) in enumerate(tries):
            try:
                measured = layer_costs.measure(
                    module, layers, run, found, kinds, counts, levers, rows=rows
                )
                break
            except Exception as exc:  # noqa: BLE001 (a model a cut batch does not fit)
                if i + 1 == len(tries):
                    raise
                note = f"{tries[i + 1][2]} ({type(exc).__name__}: {exc}), taken as proportional"
    return {
        "cost_model": measured.model.to_dict(),
        "measured": {
            "rows": measured.rows,
            "tokens": measured.tokens,
            "batch": batch,
            "seconds": measured.seconds,
            "outside_bytes": measured.outside,
            "note": note,
            "levers": {
                "shares": measured.shares,
                "not_offered": measured.not_offered,
                "refused": {
                    lever: {"layers": sorted(by_layer), "why": next(iter(by_layer.values()))}
                    for lever, by_layer in measured.refused.items()
                },
            },
            "layers": [
                {
                    "plain_bytes": c.plain,
                    "checkpointed_bytes": c.checkpointed,
                    "recompute_s": c.seconds,
                    "offloaded_bytes": c.offloaded,
                    "feed_forward_bytes": c.feed_forward,
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
    line = f"gcpatch: rank {rank()} budget {name}: {_line(chosen, outcome, name)}"
    below = "plan" in outcome and outcome["plan"]["below_floor"]
    level = logging.WARNING if "skipped" in outcome or below else logging.INFO
    log.log(level, "%s", headline.wrap(line))
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


def _line(chosen: budget_mod.Budget, outcome: dict, prefix: str = "") -> str:
    """The plan in at most two terminal rows: what is checkpointed, what it holds against the
    step without checkpointing, what it recomputes, and what the measuring cost, once; each
    layer, lever and refusal is in the record's details (`gcpatch explain -v`)."""
    size = budget_mod.size
    if "skipped" in outcome:
        return (
            f"memory budget {chosen.text} not applied, every checkpointed layer kept:"
            f" {outcome['skipped']}"
        )
    plan = outcome["plan"]
    plain = plan["plain_bytes"] or 1.0
    handed = " (rank 0's cost model)" if outcome.get("from_rank0") else ""
    rows, tokens = outcome.get("shape") or (0, 0)
    source = f" at {rows} x {tokens} tokens" if rows else ""
    modes = plan.get("modes") or []
    levered = sum(1 for mode in modes if mode not in (solver.PLAIN, solver.FULL))
    kept = (
        selective.kept_text(modes),
        selective.kept_text(modes, brief=True),
        f" ({levered} with a lever)" if levered else "",
    )
    if plan["below_floor"]:
        head = (
            f"memory budget {chosen.text} ({size(plan['limit_bytes'])}) is below the floor of full"
            f" checkpointing, {size(plan['floor_bytes'])} ({plan['floor_bytes'] / plain:.0%} of"
            f" {size(plan['plain_bytes'])} without checkpointing): all {plan['layers']} layers"
            f" checkpointed{handed}"
        )
        # what gives way first: the shape, the measuring's words, the levers' names
        return _fit(
            prefix, head, [(kept, (2, 3)), ((source, ""), (0,)), (_cost_text(outcome), (1,))]
        )
    full = plan["full_recompute_s"] or 1.0
    every = (
        f", every_n_layers={plan['every_n_layers']}"
        if plan["every_n_layers"] and plan["checkpointed"]
        else ""
    )
    head = (
        f"memory budget {chosen.text}: {plan['checkpointed']} of {plan['layers']} layers"
        f" checkpointed{handed}"
    )
    exact = plan.get("exact", True)
    greedy = ("", "", "") if exact else (solver.search_text(exact), " (greedy)", "")
    if not exact and kept[2]:  # the shortest form says both in one bracket
        kept = (*kept[:2], kept[2].replace(")", ", greedy)"))
    figures = (
        f"; holds {size(plan['planned_bytes'])}, {plan['planned_bytes'] / plain:.0%} of"
        f" {size(plan['plain_bytes'])} without checkpointing (full checkpointing"
        f" {plan['floor_bytes'] / plain:.0%}); recompute {plan['recompute_s'] / full:.0%} of full"
        " checkpointing's"
    )
    short = figures.replace(" without checkpointing (full checkpointing", " (full")
    # in the line's order; the number is when each gives way to its short form: the layer
    # pattern, the shape, the search's words, the figures', the measuring's, the refusals', and
    # the levers' names last
    parts = [
        ((every, ""), (0,)),
        (kept, (5, 7)),
        (greedy if kept[2] else greedy[:2], (2, 7) if kept[2] else (2,)),
        ((source, ""), (1,)),
        ((figures, short.replace(" of full checkpointing's", " of full's")), (3,)),
        (_refused_text(outcome), (6,)),
        (_cost_text(outcome), (4,)),
    ]
    return _fit(prefix, head, parts)


def _fit(prefix: str, head: str, parts: list[tuple[tuple[str, ...], tuple[int, ...]]]) -> str:
    """`head`, then `parts` within two terminal rows. Each part is its forms, longest first, and
    the steps at which it gives way to the next: step by step the parts shorten until the line
    fits; all of it stays in the record's details (`gcpatch explain -v`)."""
    steps = max((n for _, at in parts for n in at), default=-1) + 2
    for step in range(steps):
        line = head + "".join(forms[sum(n < step for n in at)] for forms, at in parts)
        if len(headline.wrap(f"gcpatch: rank 0 budget {prefix}: {line}").splitlines()) <= 2:
            break
    return line


def _cost_text(outcome: dict) -> tuple[str, str]:
    """What the first step's measuring took, said once (a plan handed over took none here), and
    in short."""
    seconds = (outcome.get("measured") or {}).get("seconds")
    if not seconds:
        return "", ""
    return f"; measuring took {seconds:.2g} s, once", f"; measured in {seconds:.2g} s"


def _refused_text(outcome: dict) -> tuple[str, str]:
    """The levers a trial run refused, by name, and in short (why: in the details): ("; keeping
    the matmuls refused on 4 of 8 layers", "; 1 lever refused")."""
    measured = outcome.get("measured") or {}
    refused = (measured.get("levers") or {}).get("refused") or {}
    layers = len(measured.get("layers") or [])
    full = "".join(
        f"; {selective.NAMED[lever].name} refused on {len(r['layers'])} of {layers} layers"
        for lever, r in refused.items()
    )
    count = len(refused)
    return full, f"; {count} lever{'s' if count > 1 else ''} refused" if count else ""


def _details(outcome: dict) -> list[str]:
    measured = outcome.get("measured")
    if not measured:
        return []
    flags = outcome.get("flags", [])
    size = budget_mod.size
    tokens = "/".join(map(str, measured.get("tokens") or []))
    out = [
        f"measured on {'/'.join(map(str, measured['rows']))} of {measured['batch']} rows"
        + (f" at {tokens} tokens" if tokens else "")
        + f" in {measured['seconds']:.3g} s, fitted as a cost model of the shape; outside the"
        f" layers {size(measured['outside_bytes'])}"
        + (f"; {measured['note']}" if measured.get("note") else "")
    ]
    levers = measured.get("levers")
    if levers:
        out += _levers(levers, (outcome.get("cost_model") or {}).get("matmul_shares") or {})
    for i, layer in enumerate(measured["layers"]):
        offloaded = layer.get("offloaded_bytes")
        split = layer.get("feed_forward_bytes")
        out.append(
            f"layer {i}: {'checkpointed' if i < len(flags) and flags[i] else 'plain'}; holds "
            f"{size(layer['plain_bytes'])} plain, {size(layer['checkpointed_bytes'])} "
            "checkpointed"
            + (f", {size(split)} with its feed-forward block alone" if split is not None else "")
            + (f", {size(offloaded)} offloaded" if offloaded is not None else "")
            + f"; recompute {layer['recompute_s'] * 1e3:.3g} ms"
        )
    return out


def _levers(levers: dict, counted: dict | None = None) -> list[str]:
    """What each lever between plain and whole measured (`counted`: its matmul FLOPs, the cost
    model's), or why it was not there to choose."""
    out = []
    for lever, share in levers["shares"].items():
        named = selective.NAMED[lever]
        name = named.name
        refused = (levers.get("refused") or {}).get(lever)
        if levers["not_offered"] and lever in selective.LEVERS:
            out.append(f"{name}: not offered, {levers['not_offered']}")
        elif refused and share is None:
            out.append(f"{name}: not offered, its trial failed ({refused['why']})")
        elif share is None:
            idle = "its policy kept nothing" if lever in selective.LEVERS else f"it {named.idle}"
            out.append(f"{name}: not chosen, its cost could not be told on this clock (or {idle})")
        else:
            flops = (counted or {}).get(lever)
            out.append(
                f"{name}: costs {share:.2f} of a whole layer's recompute (measured on one layer)"
                + ("" if flops is None else f", {flops:.2f} of its matmul FLOPs (counted)")
                + (
                    f"; not offered on layers {refused['layers']}, their trial failed"
                    f" ({refused['why']})"
                    if refused
                    else ""
                )
            )
    return out


class Confirmation:
    """GCPATCH_VERIFY=1: counts what the first forward with the plan in place really holds, and
    says it in one line (first_step starts it before that forward and ends it after)."""

    def __init__(self, name: str, outcome: dict, model: Any = None) -> None:
        self.name, self.outcome = name, outcome
        self.plans = shapes.of(model) if model is not None else None
        # on an accelerator its memory alone: offloaded inputs wait in host memory
        self.held = Held(device_only=model is not None and offload.accelerator(model) is not None)

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
        plan = plan_dict(last) if last is not None else self.outcome["plan"]
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
    if "cost_model" in outcome:
        outcome["from_rank0"] = True  # rank 0's cost model: this rank plans its own shapes by it
    return outcome
