"""The first training steps of each model gcpatch decided for, from one pair of hooks per model:
verify before the first forward, the memory budget's probe through the first step, its plan
before the second.

A pre-hook and a forward hook sit on the model, and on its base model (peft < 0.18 enters the
model's `forward` without a module call: then only the base model's hooks run). At the first
forward that builds a graph (not one of gcpatch's own passes, not inside torch.compile's tracing,
not one asking for a KV cache): verify runs (GCPATCH_VERIFY=1) and may correct the set-up before
the user's forward does; the budget's probe (GCPATCH_MEMORY_BUDGET) reads that step's forward and
backward, and the next training forward gets the plan. With verify too, that forward is counted.
Then the hooks are gone. A deep copy of the model made while they wait gets hooks of its own.
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any, Callable

from gcpatch import budget as budget_mod
from gcpatch import context, lifetime
from gcpatch.step import invisible, planner, shapes, verify
from gcpatch.step.training import compiled_training_forward, training_forward

log = logging.getLogger("gcpatch")

# waiting: for the first training forward; forward: it runs probed; probed: its backward may run,
# the next training forward gets the plan; confirm: that forward is counted (verify + budget);
# done: the hooks are gone
WAITING, FORWARD, PROBED, CONFIRM, DONE = "waiting", "forward", "probed", "confirm", "done"


class FirstStep:
    """What runs at one model's first training step, and the hooks that run it."""

    def __init__(
        self,
        model: Any,
        chosen: budget_mod.Budget | None,
        verifying: bool,
        correct: verify.Correct | None,
    ) -> None:
        self.model = weakref.ref(model) if model is not None else None
        self.budget, self.verifying, self.correct = chosen, verifying, correct
        self.phase = WAITING
        self.entered: Any = None  # the module whose forward this step is (the model or its base)
        self.probe: planner.Probe | None = None
        self.outcome: planner.Outcome | None = None
        self.confirmation: planner.Confirmation | None = None
        self.before, self.after = _Before(self), _After(self)
        self.handles: list[Any] = []
        self.said_compiled = False

    def register(self, modules: list[Any]) -> None:
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self.before, with_kwargs=True))
            self.handles.append(
                module.register_forward_hook(self.after, with_kwargs=True, always_call=True)
            )
        self.modules = [weakref.ref(m) for m in modules]

    def started(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.phase == WAITING and not self.said_compiled and compiled_training_forward(kwargs):
            self.said_compiled = _compiled(self)  # run by dynamo as it traces: no graph break
            return
        if not training_forward(kwargs) or (
            self.entered is not None and module is not self.entered
        ):
            return
        model = self.model() if self.model is not None else None
        if model is None:
            self.finish()
            return
        if self.phase == WAITING:
            self.entered = module
            if self.verifying:
                verify.run(model, module, args, kwargs, self.correct)
            self._probe(model, args, kwargs)
        elif self.phase in (FORWARD, PROBED):  # FORWARD: the probed forward never returned
            self._plan(model, module, args, kwargs)
        elif self.phase == CONFIRM and self.confirmation is None:
            self._confirm(model)

    def _probe(self, model: Any, args: tuple, kwargs: dict) -> None:
        if self.budget is None:
            self.finish()
            return
        found = planner.start(model, args, kwargs, self.budget)
        if isinstance(found, planner.Outcome):
            planner.report(context.name(model), self.budget, found)
            self.finish()
            return
        self.probe, self.phase = found, FORWARD

    def _plan(self, model: Any, module: Any, args: tuple, kwargs: dict) -> None:
        probe, self.probe = self.probe, None
        if probe is None:
            self.finish()
            return
        self.outcome = planner.plan(model, module, args, kwargs, self.budget, probe)
        if self.outcome is None:  # the probed step showed too little: this one is probed
            self._probe(model, args, kwargs)
        elif self.verifying and self.outcome.planned:
            self._confirm(model)
        else:
            self.finish()

    def _confirm(self, model: Any) -> None:
        self.phase = CONFIRM
        self.confirmation = planner.Confirmation(context.name(model), self.outcome, model)
        self.confirmation.__enter__()

    def returned(self, module: Any, output: Any) -> None:
        if module is not self.entered or invisible.active():
            return
        if self.phase == CONFIRM and self.confirmation is not None:
            confirmation, self.confirmation = self.confirmation, None
            if output is None:  # the forward raised: count the next one instead
                confirmation.abandon()
                return
            confirmation.done(output)
            self.finish()
        elif self.phase == FORWARD and self.probe is not None:
            self.probe.forward_done()
            self.phase = PROBED

    def finish(self) -> None:
        self.phase = DONE
        if self.probe is not None:
            probe, self.probe = self.probe, None
            probe.finish()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for ref in getattr(self, "modules", ()):  # a copy's hooks have no handle
            module = ref()
            if module is not None:
                _remove(module, self.before, self.after)

    def __deepcopy__(self, memo: dict) -> FirstStep:
        model = self.model() if self.model is not None else None
        twin = FirstStep(memo.get(id(model)), self.budget, self.verifying, self.correct)
        twin.modules = [
            weakref.ref(memo[id(m())]) for m in getattr(self, "modules", ()) if id(m()) in memo
        ]
        return twin

    def __reduce__(self) -> Any:
        model = self.model() if self.model is not None else None
        return FirstStep, (model, self.budget, self.verifying, self.correct)


def _compiled(step: FirstStep) -> bool:
    """A training forward of a model whose first step's work waits is being compiled: that work
    (the budget's measuring and plan, verify) is eager and waits for an eager training forward,
    which a job whose forwards all run compiled never has; said once per model. Marked as
    dynamo's `assume_constant_result` (below): dynamo calls it while it traces, and keeps its
    result as a constant, so the compiled graph has no break and never calls it again."""
    model = step.model() if step.model is not None else None
    if model is None:
        return True
    what = " and ".join(
        part
        for part in (
            f"memory budget {step.budget.text}" if step.budget is not None else "",
            "verify" if step.verifying else "",
        )
        if part
    )
    log.warning(
        "gcpatch: %s for %s not applied to its compiled forward: gcpatch does that work at an eager"
        " training forward, and this one runs compiled by torch.compile; checkpointing stays as"
        " enabled (torch.compile's own budget: torch._functorch.config.activation_memory_budget)",
        what,
        context.name(model),
    )
    return True


# torch._dynamo.assume_constant_result sets exactly this (torch/_dynamo/decorators.py); set here so
# that gcpatch's import never imports dynamo
_compiled._dynamo_marked_constant = True  # type: ignore[attr-defined]


# A hook registered with kwargs and taken out by an earlier hook of the same module call is still
# called in that call, as torch calls a hook without them (module.py reads the with-kwargs flag as
# it goes): our hooks take that call as the no-op it should be. `_TAKEN_OUT`: the output a forward
# hook then misses.
_TAKEN_OUT = object()


class _Before:
    """The pre-hook of a FirstStep: module-level, so a model carrying it copies and pickles."""

    def __init__(self, step: FirstStep) -> None:
        self.step = step

    def __call__(self, module: Any, args: tuple, kwargs: dict | None = None) -> None:
        if kwargs is not None:  # None: taken out mid-call
            self.step.started(module, args, kwargs)

    def __deepcopy__(self, memo: dict) -> _Before:
        return copy.deepcopy(self.step, memo).before

    def __reduce__(self) -> Any:
        return _before_of, (self.step,)


class _After:
    """The forward hook of a FirstStep (always called: a forward that raised ends a count)."""

    def __init__(self, step: FirstStep) -> None:
        self.step = step

    def __call__(self, module: Any, args: tuple, kwargs: Any, output: Any = _TAKEN_OUT) -> None:
        # taken out mid-call, it gets the output in the kwargs' place and nothing after
        if output is not _TAKEN_OUT:
            self.step.returned(module, output)

    def __deepcopy__(self, memo: dict) -> _After:
        return copy.deepcopy(self.step, memo).after

    def __reduce__(self) -> Any:
        return _after_of, (self.step,)


def _before_of(step: FirstStep) -> _Before:
    return step.before


def _after_of(step: FirstStep) -> _After:
    return step.after


def _remove(module: Any, *hooks: Any) -> None:
    for table in ("_forward_pre_hooks", "_forward_hooks"):
        entries = getattr(module, table)
        for key, value in list(entries.items()):
            if any(value is hook for hook in hooks):
                del entries[key]


# FirstStep of each model armed and not yet done (one per model; a re-enable keeps it).
_armed: weakref.WeakKeyDictionary[Any, FirstStep] = weakref.WeakKeyDictionary()


def arm(
    model: Any,
    chosen: budget_mod.Budget | None,
    verifying: bool,
    correct: Callable[..., str] | None = None,
) -> None:
    """Run the first step's work for `model` at its first training forward. Enabled again (the
    Trainer's `train()`), a model already planned gets its plan back at once, and one still
    waiting keeps its hooks."""
    if chosen is None and not verifying:
        return
    try:
        if chosen is not None and shapes.restore(model):
            chosen = None  # planned already: the plan stands, only verify may still wait
        current = _armed.get(model)
        if current is not None and current.phase != DONE:
            return
        if chosen is None and not verifying:
            return
        if current is not None and current.verifying:
            verifying = False  # verified already: once per model
        if chosen is None and not verifying:
            return
        step = FirstStep(model, chosen, verifying, correct)
        step.register(_entered(model))
        _armed[model] = step
    except Exception as exc:  # noqa: BLE001 (fail open: checkpointing stays as decided)
        log.error(
            "gcpatch: first-step work (budget, verify) not armed for %s (%s: %s); checkpointing"
            " stays as decided",
            type(model).__name__,
            type(exc).__name__,
            exc,
        )


def _entered(model: Any) -> list[Any]:
    """The modules whose hooks see the model's first forward: the model, and its base model, since
    peft < 0.18 enters the model's `forward` without a module call."""
    base = getattr(model, "base_model", None)
    if base is None or base is model or not hasattr(base, "register_forward_pre_hook"):
        return [model]
    return [model, base]


@lifetime.activation
def reset() -> None:
    """Forget which models were armed (their hooks stay with them and stand aside once done)."""
    try:
        for step in list(_armed.values()):
            step.finish()
    finally:
        _armed.clear()
