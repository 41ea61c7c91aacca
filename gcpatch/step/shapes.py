"""A budgeted model's plan at every training step, chosen by the step's batch shape.

Once the first step was probed (gcpatch/step/planner.py), a forward pre-hook on the module that
step entered applies each training forward's plan before it runs, through the layers' own flags
and checkpoint functions: a shape seen before takes its cached plan, a new one is solved from the
cost model (gcpatch/step/cost_model.py). A fraction is of that step's own activations without
checkpointing; a size holds for every step; `auto` is what the device has left at that step.
Forwards without gradients, inside torch.compile's tracing or asking for a KV cache plan nothing.
Said: the first plan, then a shape with another plan, each new largest shape and the first below
the floor, and under ZeRO-3 an agreed plan that is not the rank's own, at most MAX_LINES lines;
every new shape's plan to the record (MAX_RECORDED) and DEBUG.
"""

from __future__ import annotations

import copy
import logging
import sys
import weakref
from collections import OrderedDict
from typing import Any

from gcpatch import budget as budget_mod
from gcpatch import context, headline, lifetime, ranks, record, settings
from gcpatch.ranks import rank
from gcpatch.step import levers, plan_lines, receipts, solver
from gcpatch.step.batch import shape
from gcpatch.step.cost_model import CostModel
from gcpatch.step.levers.offload import accelerator_of
from gcpatch.step.outcome import plan_dict
from gcpatch.step.training import training_forward

log = logging.getLogger("gcpatch")
MAX_CACHED = 256  # shapes whose plan is kept (the oldest goes first)
MAX_LINES = 8  # INFO/WARNING lines about later shapes, per model
MAX_RECORDED = 64  # shapes whose plan goes to the record, per model


# model -> its plans (the module the hook sits on may be the base model inside a wrapper)
_plans: weakref.WeakKeyDictionary[Any, ShapePlans] = weakref.WeakKeyDictionary()


@lifetime.activation
def reset() -> None:
    """Forget every plan (a re-activation starts as a fresh process)."""
    _plans.clear()


def of(model: Any) -> ShapePlans | None:
    return _plans.get(model)


def restore(model: Any) -> bool:
    """A model planned already, enabled again (the framework's enable has just switched every layer
    on): its plan back at once. Whether it had one."""
    plans = _plans.get(model)
    if plans is None:
        return False
    if plans.last is not None:
        plans.apply(plans.last)
    return True


class ShapePlans:
    """One model's plans by batch shape, and the pre-hook that applies them."""

    def __init__(
        self,
        model: Any,
        layers: list[Any],
        costs: CostModel,
        chosen: budget_mod.Budget,
        name: str,
    ) -> None:
        self.model = weakref.ref(model)
        self.layers = layers
        self.costs, self.chosen, self.name = costs, chosen, name
        self.plans: OrderedDict[tuple, solver.Plan] = OrderedDict()
        self.first: list[str] | None = None  # the first plan's modes (levers told apart)
        self.last: solver.Plan | None = None  # the plan applied at the latest training forward
        self.largest = 0
        self.lines = 0
        self.recorded = 0
        self.said_changed = self.said_floor = False
        # (rows, tokens, agreed modes) -> (the rank's own plan, the agreed one, priced and said)
        self.agreed_plans: dict[tuple, tuple] = {}
        self.handle: Any = None
        # each layer's own checkpoint function, and it under each lever the layer is offered
        self.funcs = [levers.own(vars(m).get("_gradient_checkpointing_func")) for m in layers]
        self.lever_funcs: list[dict[str, Any]] = [
            {
                lever.name: lever.wrap(f, m)
                for lever in levers.every()
                if lever is not levers.WHOLE and lever.name in c.held and f is not None
            }
            for m, f, c in zip(layers, self.funcs, costs.layers if costs is not None else [])
        ]
        self.misfired: set[tuple[int, str]] = set()  # (layer, lever) that did nothing
        self.checked: set[str] = set()  # the levers whose firing was checked
        self.ran = False  # a training forward ran with a plan this hook applied
        self.after: Any = None
        self.receipts = (
            receipts.Receipts(name, bool(layers) and accelerator_of(layers[0]) is not None)
            if settings.read().verify and model is not None
            else None
        )
        self.tighter: dict[tuple, float] = {}  # shape key -> what its step overshot its plan by
        # ZeRO-3 gathers a layer's parameters again in its recompute: every rank must run one
        # plan at each step, or their gathers pair up wrongly (a hang); the ranks agree on it
        # (read off the layers: a deep copy's model is still being built when its plans are)
        self.lockstep = any(hasattr(p, "ds_id") for m in layers for p in m.parameters())

    def plan_for(self, rows: int, tokens: int, available: float | None = None) -> solver.Plan:
        """The plan for this shape (and, under `auto`, this much room): cached, or solved."""
        key = (rows, tokens, _bucket(available, self.chosen))
        found = self.plans.get(key)
        if found is not None:
            self.plans.move_to_end(key)
            return found
        layers, outside, baseline = self.costs.at(rows, tokens)
        limit = self.chosen.limit(baseline, available) / self.tighter.get(key, 1.0)
        found = solver.solve(layers, outside, limit, self.costs.calls_at(rows, tokens))
        found.baseline = baseline
        self.plans[key] = found
        if self.receipts is not None and key not in self.tighter:
            self.receipts.start(key, found)
        if len(self.plans) > MAX_CACHED:
            self.plans.popitem(last=False)
        self._said(rows, tokens, found)
        return found

    def agreed(
        self, plan: solver.Plan | None, rows: int = 0, tokens: int = 0
    ) -> solver.Plan | None:
        """Under ZeRO-3, the plan every rank runs at this forward (of shape rows x tokens): per
        layer the strongest of the ranks' modes (plain, the levers between, whole, below whole),
        its figures its own; a forward that plans nothing joins with none. Elsewhere `plan`."""
        if not self.lockstep:
            return plan
        order = _strengths()
        n = len(self.layers)
        mine = [order.get(mode, 0) for mode in plan.modes] if plan is not None else [0] * n
        found = ranks.agree_max(mine)
        if plan is None:
            return None
        whole = levers.WHOLE.name
        if found is None:
            modes = [whole] * len(plan.modes)  # no agreement: every layer checkpointed
        else:
            names = {strength: name for name, strength in order.items()}
            modes = [names.get(k, whole) for k in found]
            modes = [
                m if m in (solver.PLAIN, whole) or m in self.lever_funcs[i] else whole
                for i, m in enumerate(modes)
            ]
        if modes == plan.modes:
            return plan
        key = (rows, tokens, tuple(modes))
        own, ran = self.agreed_plans.get(key, (None, None))
        if own is not plan or ran is None:  # priced and said once per own plan and agreed modes
            layers, outside, _ = self.costs.at(rows, tokens)
            calls = self.costs.calls_at(rows, tokens)
            ran = solver.with_modes(plan, layers, outside, calls, modes)
            if len(self.agreed_plans) >= MAX_CACHED:
                self.agreed_plans.clear()
            self.agreed_plans[key] = (plan, ran)
            self._said_agreed(rows, tokens, plan, ran)
        return ran

    def _said_agreed(self, rows: int, tokens: int, own: solver.Plan, ran: solver.Plan) -> None:
        """What the ranks run where it is not this rank's own plan."""
        size = budget_mod.size
        line = (
            f"gcpatch: rank {rank()} budget {self.name}: {rows} x {tokens} tokens, the ranks'"
            f" agreed plan (ZeRO-3 runs one plan on every rank): {ran.count} of"
            f" {len(ran.modes)} layers checkpointed{plan_lines.levers_text(ran)}; activations"
            f" {size(ran.total)} (this rank's own plan: {own.count} layers, {size(own.total)})"
        )
        level = logging.DEBUG
        if self.lines < MAX_LINES:
            self.lines += 1
            level = logging.INFO
        log.log(level, "%s", headline.wrap(line))
        self._record("budget-agreed", line, rows, tokens, own=plan_dict(own), plan=plan_dict(ran))

    def apply(self, plan: solver.Plan) -> None:
        for i, (layer, mode) in enumerate(zip(self.layers, plan.modes)):
            flag = mode != solver.PLAIN
            if layer.gradient_checkpointing is not flag:
                layer.gradient_checkpointing = flag
            func = self.funcs[i]
            if mode in self.lever_funcs[i] and (i, mode) not in self.misfired:
                func = self.lever_funcs[i][mode]
            if func is not None and vars(layer).get("_gradient_checkpointing_func") is not func:
                layer._gradient_checkpointing_func = func
        self.last = plan

    def fired(self) -> None:
        """After the first forward that ran a plan with a lever (or offloading): a layer planned
        that way whose policy kept nothing (whose block never ran, that moved nothing) did not do
        what the plan assumed; it checkpoints whole from now on, said once per lever (every lever
        checked: nothing to do, on every later step)."""
        if not self.ran or self.last is None:
            return
        modes = self.last.modes
        fresh = {mode for i, mode in enumerate(modes) if mode in self.lever_funcs[i]}
        fresh -= self.checked
        if not fresh:
            return
        self.checked |= fresh
        idle = [(i, mode) for i, mode in enumerate(modes) if mode in fresh and self._idle(i, mode)]
        if not idle:
            return
        self.misfired.update(idle)
        self.plans.clear()  # solved again without the lever where it misfired
        for lever in levers.every():
            layers = [i for i, mode in idle if mode == lever.name]
            for i in layers:
                self.costs.drop(i, lever.name, f"{lever.title} {lever.idle} in a step")
            if layers:
                log.warning(
                    "gcpatch: rank %d budget %s: %s %s in layer(s) %s%s; they checkpoint"
                    " whole from the next step",
                    rank(),
                    self.name,
                    lever.title,
                    lever.idle,
                    ", ".join(map(str, layers)),
                    self._why(layers, lever.name),
                )

    def _why(self, layers: list[int], lever: str) -> str:
        """Why offloading moved nothing, where a copy to the host failed (the first reason)."""
        if not getattr(levers.get(lever), "below_whole", False):
            return ""
        failed = [getattr(self.lever_funcs[i].get(lever), "failed", None) for i in layers]
        reason = next((why for why in failed if why), None)
        return f" (the copy to the host failed: {reason})" if reason else ""

    def _idle(self, i: int, mode: str) -> bool:
        """Whether layer i's lever did nothing in the forwards it ran."""
        lever = levers.get(mode)
        return lever is not None and not lever.fired(self.lever_funcs[i][mode])

    def __call__(self, module: Any, args: tuple, kwargs: dict | None = None) -> None:
        """The pre-hook: this forward's plan, before it runs. Fails open (the flags as they are)."""
        if kwargs is None:
            return  # taken out mid-call: no kwargs
        try:
            self._before(args, kwargs)
        except Exception as exc:  # noqa: BLE001 (fail open: this step runs with the flags it has)
            log.error(
                "gcpatch: rank %d budget %s: no plan for this step (%s: %s); the flags stay as"
                " they are",
                rank(),
                self.name,
                type(exc).__name__,
                exc,
            )

    def _before(self, args: tuple, kwargs: dict) -> None:
        if not training_forward(kwargs):
            self.agreed(None)  # under ZeRO-3 every forward joins the ranks' agreement
            return
        model = self.model()
        known = context.known(model) if model is not None else None
        if known is None or not known.enabled:
            return  # gone, or its checkpointing disabled by the user: nothing to plan
        self.fired()
        torch = sys.modules["torch"]
        found = shape(torch, args, kwargs)
        if found is None:
            return
        available = available_bytes(model, self.chosen) if self.chosen.auto else None
        self.apply(self.agreed(self.plan_for(*found, available), *found))
        self.ran = True

    def _said(self, rows: int, tokens: int, plan: solver.Plan) -> None:
        size = budget_mod.size
        kept = plan_lines.levers_text(plan) + solver.search_text(plan.exact)
        what = (
            f"{rows} x {tokens} tokens: {plan.count} of {len(plan.checkpoint)} layers"
            f" checkpointed{kept};"
            f" activations {size(plan.total)} of {size(plan.baseline)} without checkpointing"
            f" (budget {size(plan.limit)})"
        )
        if self.first is None:  # the planner's own first line says it
            self.first, self.largest = list(plan.modes), rows * tokens
            return
        why = ""
        if plan.below_floor and not self.said_floor:
            self.said_floor = True
            why = (
                f"the budget is below the floor of full checkpointing here, {size(plan.floor)}:"
                " every layer checkpointed at"
            )
        elif rows * tokens > self.largest:
            why = "a new largest shape,"
        elif plan.modes != self.first and not self.said_changed:
            why = "a shape with another plan,"
        self.largest = max(self.largest, rows * tokens)
        self.said_changed = self.said_changed or plan.modes != self.first
        line = f"gcpatch: rank {rank()} budget {self.name}: {why or 'shape'} {what}"
        level = logging.DEBUG
        if why and (self.lines < MAX_LINES or plan.below_floor):
            self.lines += 1
            level = logging.WARNING if plan.below_floor else logging.INFO
        log.log(level, "%s", headline.wrap(line))
        self._record(
            "budget-shape", line, rows, tokens, flags=plan.checkpoint, plan=plan_dict(plan)
        )

    def _record(self, stage: str, line: str, rows: int, tokens: int, **plans: Any) -> None:
        """A shape's line and plans to the record, for the first MAX_RECORDED of them."""
        if self.recorded >= MAX_RECORDED:
            return
        self.recorded += 1
        event = {"stage": stage, "model": self.name, "line": line, "shape": [rows, tokens]}
        record.event({**event, **plans}, settings.read().record_dir)

    def returned(self, module: Any, args: tuple, output: Any) -> None:
        """After a forward (GCPATCH_VERIFY=1): a new shape's receipt; over its plan, that shape is
        planned again."""
        if self.receipts is None:
            return
        try:
            over = self.receipts.done(output)
        except Exception as exc:  # noqa: BLE001 (fail open: the step goes on uncounted)
            log.error("gcpatch: rank %d budget %s: no receipt (%s)", rank(), self.name, exc)
            return
        if over is not None:
            key, ratio = over
            self.tighter[key] = self.tighter.get(key, 1.0) * ratio
            self.plans.pop(key, None)

    def install(self, module: Any) -> None:
        """The pre-hook on `module` (the model, or the base model its forward enters), and with
        GCPATCH_VERIFY=1 a forward hook for the receipts; these plans replace any the model had."""
        model = self.model()
        old = _plans.get(model)
        if old is not None:
            old.remove()
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)
        if self.receipts is not None:
            self.after = module.register_forward_hook(self.returned, always_call=True)
        _plans[model] = self

    def remove(self) -> None:
        for handle in (self.handle, self.after):
            if handle is not None:
                handle.remove()
        self.handle = self.after = None

    def __deepcopy__(self, memo: dict) -> ShapePlans:
        """A deep copy of the model (a reference or EMA copy) gets plans of its own, bound to the
        copy's layers, from the same cost model; the copy is known as its original was (enabled,
        so planned at every step, until its own disable). A copy of a part that does not hold the
        model and its layers gets inert plans: it never sets another model's flags."""
        model = self.model()
        twin_model = memo.get(id(model))
        if model is None or twin_model is None:
            twin = ShapePlans(model, [], self.costs, self.chosen, self.name)
            twin.model = _nothing
            return twin
        # the hooks are copied before the submodules (a module's __dict__ order): the layers'
        # copies made here are the ones the copy's submodules then take from the memo
        layers = [copy.deepcopy(layer, memo) for layer in self.layers]
        context.copied(model, twin_model)
        costs = CostModel.from_dict(self.costs.to_dict())
        twin = ShapePlans(twin_model, layers, costs, self.chosen, context.name(twin_model))
        twin.first, twin.largest, twin.misfired = self.first, self.largest, set(self.misfired)
        _plans[twin_model] = twin
        return twin

    def __reduce__(self) -> Any:
        return _unpickled, (self.model(), self.layers, self.costs, self.chosen, self.name)


def _nothing() -> None:
    return None


def _unpickled(model: Any, layers: list, costs: CostModel, chosen: Any, name: str) -> ShapePlans:
    return ShapePlans(model, layers, costs, chosen, name)


def _bucket(available: float | None, chosen: budget_mod.Budget) -> int | None:
    """`auto`'s room, rounded down to 1/256 of the capacity, so a plan is reused while what the
    job holds moves a little; never rounded up."""
    if available is None:
        return None
    step = max(1.0, (chosen.capacity or available or 1.0) / 256)
    return int(available // step)


def available_bytes(model: Any, chosen: budget_mod.Budget) -> float | None:
    """What `auto` leaves for activations at this step: the device's capacity (or the one stated)
    minus what the job holds on it now (weights, gradients, optimizer state, anything else) minus
    the margin. On a CPU without a stated capacity: None (nothing to measure)."""
    torch = sys.modules["torch"]
    device = next((p.device for p in model.parameters()), None)
    if device is not None and device.type == "cuda":
        capacity = chosen.capacity or torch.cuda.get_device_properties(device).total_memory
        in_use = float(torch.cuda.memory_allocated(device))
    elif chosen.capacity is not None:
        capacity, in_use = chosen.capacity, float(_model_bytes(model))
    else:
        return None
    return capacity - in_use - budget_mod.AUTO_MARGIN * capacity


def _model_bytes(model: Any) -> int:
    """The storages of the model's parameters and their gradients (what a CPU job is known to
    hold; its optimizer's state is not visible from the model)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        for t in (p, p.grad):
            if t is not None:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _strengths() -> dict[str, int]:
    """Each mode's place from holding the most to the fewest bytes: plain, the levers between
    plain and whole (the last filled first), whole, those below whole."""
    between = [lever.name for lever in levers.every() if not lever.below_whole]
    between = [name for name in between if name != levers.WHOLE.name][::-1]
    below = [lever.name for lever in levers.every() if lever.below_whole]
    order = [solver.PLAIN, *between, levers.WHOLE.name, *below]
    return {name: i for i, name in enumerate(order)}
