"""The decision context: who is asking, what gcpatch knows about each model between calls, and
whether one of gcpatch's own passes is running.

One owner for the state a decision reads and leaves behind. `Asker` says who is asking for the
enable in progress (the user, a Trainer, a framework on the user's behalf, a re-decision after a
wrap); `ModelContext` is what is known of one model across calls (the user's last explicit ask,
how to replay the enable, what was learnt when it was wrapped, the last decision); a
`DecisionContext` joins the two for one enable call. apply.py owns only what was installed on
the model (hooks, `use_cache`, the eval-mode fix).
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Mapping

from gcpatch import lifetime
from gcpatch.schema import USE_REENTRANT, Source
from gcpatch.value_class import Value, value_class


@value_class()
class Asker(Value):
    """Who is asking for the enable call in progress (one context variable holds all of it)."""

    inside: bool = False  # an enable nested in one gcpatch is deciding: the outer decision stands
    redecided_by: str | None = None  # a re-decision after the model was wrapped (PEFT, DDP)
    caller: str | None = None  # a framework enabling on the user's behalf (peft's kbit preparation)
    trainer: Any = None  # the Trainer whose train() is running


_NOBODY = Asker()  # frozen: one shared default is safe
_asker: contextvars.ContextVar[Asker] = contextvars.ContextVar("gcpatch_asker", default=_NOBODY)


def asker() -> Asker:
    return _asker.get()


@contextmanager
def asking(**changes: Any) -> Iterator[Asker]:
    """Run a block with these fields of `Asker` set (nested blocks see both)."""
    token = _asker.set(replace(_asker.get(), **changes))
    try:
        yield _asker.get()
    finally:
        _asker.reset(token)


# gcpatch's own passes at the first step in progress (nested: a pass inside a pass). step.invisible
# counts them; the layers below it (crash_notes, which leaves a failure inside a pass to the pass's
# own line) read `in_own_pass()` here instead of reaching up into step.
_own_passes = [0]


def own_pass_began() -> None:
    _own_passes[0] += 1


def own_pass_ended() -> None:
    _own_passes[0] -= 1


def in_own_pass() -> bool:
    """Whether one of gcpatch's own passes of the user's model (step.invisible) runs now."""
    return _own_passes[0] > 0


class ModelContext:
    """What gcpatch knows about one model between decisions."""

    __slots__ = ("ask", "ask_from", "replay", "wrapped", "trainer", "last", "evidence", "instance")

    def __init__(self, instance: int = 1) -> None:
        self.ask: dict[str, Any] | None = None  # the user's last explicit model-level kwargs
        self.ask_from = ""
        # re-runs the public enable (re-decisions)
        self.replay: Callable[[Any, Any], Any] | None = None
        self.wrapped: dict[str, Any] = {}  # facts learnt at wrap time (DDP)
        self.trainer = ""
        self.last: dict[str, Any] | None = None  # the last decision's record
        # votes from what was measured on this model's real step (verify in fix mode): they take
        # part in every later decision for it, as evidence outranks what the enable call inferred
        self.evidence: list[Any] = []
        # the how-manieth model of its class gcpatch met: the record and `gcpatch explain` tell
        # two models of one class apart ("GPT2LMHeadModel #2"); a repeat is counted per model
        self.instance = instance

    @property
    def enabled(self) -> bool:
        """Checkpointing is on by an enable gcpatch decided, and no disable came since."""
        return self.replay is not None


_models: weakref.WeakKeyDictionary[Any, ModelContext] = weakref.WeakKeyDictionary()
_instances: dict[str, int] = {}  # class name -> models of that class met so far


@lifetime.activation
def reset() -> None:
    """Forget every model's asks, replays and decisions."""
    _models.clear()
    _instances.clear()


def of(model: Any) -> ModelContext:
    context = _models.get(model)
    if context is None:
        cls = type(model).__name__
        _instances[cls] = _instances.get(cls, 0) + 1
        context = _models[model] = ModelContext(instance=_instances[cls])
    return context


def copied(original: Any, twin: Any) -> None:
    """A deep copy of a model gcpatch decided for (a reference or EMA copy) is known as its
    original was at the copy: enabled or not, with its ask and its replay, its own from then on
    (its own disable, its own number)."""
    source = _models.get(original)
    if source is None or twin in _models:
        return
    context = of(twin)
    context.ask, context.ask_from, context.replay = source.ask, source.ask_from, source.replay
    context.trainer, context.wrapped = source.trainer, dict(source.wrapped)
    context.evidence = list(source.evidence)


def instance(model: Any) -> int:
    """The model's number among the models of its class gcpatch met (1: the first, and a model
    gcpatch never decided for)."""
    context = _models.get(model)
    return context.instance if context is not None else 1


def name(model: Any) -> str:
    """The model's class, numbered from the second model of that class on."""
    number = instance(model)
    return type(model).__name__ + (f" #{number}" if number > 1 else "")


def known(model: Any) -> ModelContext | None:
    return _models.get(model)


def decided_within(root: Any) -> list[Any]:
    """The models inside `root` (a DDP or booster wrapper) gcpatch has decided for."""
    return [module for module in root.modules() if module in _models]


@value_class(frozen=False)
class EnableCall(Value):
    """A framework's enable call, as the patch point saw it."""

    model: Any
    api: str
    # Source.CALL: the user's code; Source.TRAINER: a Trainer re-enabling (X3); a framework's name
    source: str
    asked_kwargs: Mapping[str, Any] | None  # the checkpoint kwargs asked for, None when none were
    asked_from: str
    invoke: Callable[[Mapping[str, Any] | None], Any]  # runs the original with these kwargs
    replay: Callable[[Any, Mapping[str, Any] | None], Any] | None = None  # re-enables a model later
    trainer: str = ""
    # the plugin's rule by which an earlier ask stands over a re-enable naming none
    keeps_ask: str = ""
    # what the framework's own enable runs with when the ask names no use_reentrant (None: not
    # known), and whose default that is: kept where no rule finds it wrong
    default_use_reentrant: bool | None = None
    default_from: str = ""


class DecisionContext:
    """One enable call with everything the decision reads: the call, who asked, what was asked
    in effect (an earlier ask kept over a re-enable that names none), and the model's context."""

    __slots__ = ("call", "asker", "model", "source", "asked", "asked_from")

    def __init__(
        self,
        call: EnableCall,
        asker: Asker,
        model: ModelContext,
        source: str,
        asked: Mapping[str, Any] | None,
        asked_from: str,
    ) -> None:
        self.call, self.asker, self.model, self.source = call, asker, model, source
        self.asked, self.asked_from = asked, asked_from

    @property
    def trainer(self) -> str:
        return self.call.trainer or self.model.trainer

    def chosen(self, use_reentrant: Any) -> dict[str, Any]:
        """The kwargs the framework's enable runs with: the ask, with the decided use_reentrant."""
        return {
            **(self.asked or {}),
            USE_REENTRANT.value: use_reentrant,
        }  # a plain str key: dynamo reads it

    def commit(self, entry: dict[str, Any]) -> None:
        """Remember what this call leaves for later ones: the user's explicit ask (never a
        Trainer's re-enable, X3), how to replay the enable, and the decision's record."""
        call, model = self.call, self.model
        if (
            call.asked_kwargs is not None
            and USE_REENTRANT in call.asked_kwargs
            and self.source != Source.TRAINER
        ):
            model.ask, model.ask_from = dict(call.asked_kwargs), call.asked_from
        model.replay = call.replay or model.replay
        model.trainer = self.trainer
        model.last = entry


def begin(call: EnableCall) -> DecisionContext:
    """The context of one enable call. A re-enable that names no use_reentrant (the Trainer's
    from TrainingArguments, TRL's disable_gradient_checkpointing on exit, peft's kbit preparation)
    would reset the user's earlier choice (the last writer wins, transformers#26221): that earlier
    ask stands (X3)."""
    who, model = asker(), of(call.model)
    source = who.redecided_by or who.caller or call.source
    asked, asked_from = call.asked_kwargs, call.asked_from
    if who.redecided_by and model.ask is not None:
        asked, asked_from = model.ask, f"{model.ask_from} (decided again: {who.redecided_by})"
    else:
        if who.caller and call.source == Source.CALL:
            asked_from = (
                f"{who.caller}(gradient_checkpointing_kwargs=...)"
                if call.asked_kwargs
                else f"nothing ({who.caller})"
            )
            call.asked_from = asked_from
        if (
            call.asked_kwargs is None or USE_REENTRANT not in call.asked_kwargs
        ) and model.ask is not None:
            asked = {**(call.asked_kwargs or {}), USE_REENTRANT: model.ask[USE_REENTRANT]}
            asked_from = f"{model.ask_from}, kept over a re-enable that names none" + (
                f" ({call.keeps_ask})" if call.keeps_ask else ""
            )
    return DecisionContext(call, who, model, source, asked, asked_from)
