"""A budgeted model's plan at every training step, chosen by the step's batch shape.

Once the first step measured the model (gcpatch/step/planner.py), a forward pre-hook on the module
that step entered looks at each training forward's (rows, tokens) and applies the plan for it
before the forward runs, through the layers' own `gradient_checkpointing` flags: a shape seen
before takes its cached plan (a dictionary lookup), a new one is solved from the cost model
(gcpatch/step/cost_model.py; no measuring forward). A fraction is a fraction of that step's own
activations without checkpointing; a size holds for every step; `auto` is what the device has left
at that step. Forwards without gradients (eval, generate), inside torch.compile's tracing or asking
for a KV cache plan nothing, and a model whose checkpointing the user disabled is left alone.

Said: the first plan (the planner's line), then one line for a shape whose plan differs from it the
first time, for each new largest shape, and for the first shape the budget cannot be met at (full
checkpointing, the floor), at most MAX_LINES in all; every new shape's plan goes to the record
(the first MAX_RECORDED of them) and to DEBUG.
"""

from __future__ import annotations

import copy
import logging
import sys
import weakref
from collections import OrderedDict
from typing import Any

from gcpatch import budget as budget_mod
from gcpatch import context, headline, lifetime, record, settings
from gcpatch.ranks import rank
from gcpatch.step import feed_forward, offload, selective, solver
from gcpatch.step.batch import shape
from gcpatch.step.cost_model import CostModel
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
        self.handle: Any = None
        # each layer's own checkpoint function, and the same under each selective lever, with its
        # policy (none where the layer does not offer them)
        self.funcs = [selective.own(vars(m).get("_gradient_checkpointing_func")) for m in layers]
        self.policies: list[dict[str, selective.Keep]] = [
            {lever: selective.Keep(lever) for lever in selective.LEVERS}
            if selective.offered(f)
            else {}
            for f in self.funcs
        ]
        self.lever_funcs: list[dict[str, Any]] = [
            {lever: selective.keeping(f, p) for lever, p in policies.items()}
            for f, policies in zip(self.funcs, self.policies)
        ]
        # around its feed-forward block, and offloaded, where the layer offers them
        # (gcpatch/step/feed_forward.py, gcpatch/step/offload.py)
        for m, f, funcs in zip(layers, self.funcs, self.lever_funcs):
            if selective.splittable(m):
                funcs[solver.FEED_FORWARD] = feed_forward.FeedForward(f, feed_forward.block(m))
            if selective.offloadable(m):
                funcs[solver.OFFLOAD] = offload.Offload(f)
        self.misfired: set[tuple[int, str]] = set()  # (layer, lever) that did nothing
        self.checked: set[str] = set()  # the levers whose firing was checked
        self.ran = False  # a training forward ran with a plan this hook applied

    def plan_for(self, rows: int, tokens: int, available: float | None = None) -> solver.Plan:
        """The plan for this shape (and, under `auto`, this much room): cached, or solved."""
        key = (rows, tokens, _bucket(available, self.chosen))
        found = self.plans.get(key)
        if found is not None:
            self.plans.move_to_end(key)
            return found
        layers, outside = self.costs.layers(rows, tokens)
        plain = outside + sum(layer.plain for layer in layers)
        found = solver.solve(layers, outside, self.chosen.limit(plain, available))
        self.plans[key] = found
        if len(self.plans) > MAX_CACHED:
            self.plans.popitem(last=False)
        self._said(rows, tokens, found)
        return found

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
        if not self.ran or self.last is None or len(self.checked) == len(solver.FILLED):
            return
        modes = self.last.modes
        levers = {mode for mode in modes if mode in solver.FILLED} - self.checked
        if not levers:
            return
        self.checked |= levers
        idle = [(i, mode) for i, mode in enumerate(modes) if mode in levers and self._idle(i, mode)]
        if not idle:
            return
        self.misfired.update(idle)
        self.plans.clear()  # solved again without the lever where it misfired
        for i, mode in idle:
            self.costs.lever(mode)[1][i] = None  # type: ignore[index]
        for lever in solver.FILLED:
            layers = [i for i, mode in idle if mode == lever]
            if layers:
                log.warning(
                    "gcpatch: rank %d budget %s: %s %s in layer(s) %s%s; they checkpoint"
                    " whole from the next step",
                    rank(),
                    self.name,
                    selective.NAMED[lever].name,
                    selective.NAMED[lever].idle,
                    ", ".join(map(str, layers)),
                    self._why(layers, lever),
                )

    def _why(self, layers: list[int], lever: str) -> str:
        """Why offloading moved nothing, where a copy to the host failed (the first reason)."""
        if lever != solver.OFFLOAD:
            return ""
        failed = [getattr(self.lever_funcs[i].get(lever), "failed", None) for i in layers]
        reason = next((why for why in failed if why), None)
        return f" (the copy to the host failed: {reason})" if reason else ""

    def _idle(self, i: int, mode: str) -> bool:
        """Whether layer i's lever did nothing in the forwards it ran."""
        if mode == solver.OFFLOAD:
            wrapper = self.lever_funcs[i].get(mode)
            return wrapper is not None and wrapper.moved == 0
        if mode == solver.FEED_FORWARD:
            wrapper = self.lever_funcs[i].get(mode)
            return wrapper is not None and wrapper.ran == 0
        policy = self.policies[i].get(mode)
        return policy is not None and policy.kept == 0

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
        self.apply(self.plan_for(*found, available))
        self.ran = True

    def _said(self, rows: int, tokens: int, plan: solver.Plan) -> None:
        size = budget_mod.size
        kept = selective.kept_text(plan.modes) + solver.search_text(plan.exact)
        what = (
            f"{rows} x {tokens} tokens: {plan.count} of {len(plan.checkpoint)} layers"
            f" checkpointed{kept};"
            f" activations {size(plan.total)} of {size(plan.plain_total)} without checkpointing"
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
        if self.recorded < MAX_RECORDED:
            self.recorded += 1
            record.event(
                {
                    "stage": "budget-shape",
                    "model": self.name,
                    "line": line,
                    "shape": [rows, tokens],
                    "flags": plan.checkpoint,
                    "plan": plan_dict(plan),
                },
                settings.read().record_dir,
            )

    def install(self, module: Any) -> None:
        """The pre-hook on `module` (the model, or the base model its forward enters); these plans
        replace any the model had."""
        model = self.model()
        old = _plans.get(model)
        if old is not None:
            old.remove()
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)
        _plans[model] = self

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

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


def plan_dict(found: solver.Plan) -> dict:
    return {
        "modes": found.modes,
        "kept_matmuls": found.kept_matmuls,
        "kept_attention": found.kept_attention,
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
