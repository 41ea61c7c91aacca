"""The decision point at the checkpoint call itself, where every path meets.

An enable-time decision knows the user's intent but sees only the calls that come through a
framework's enable (transformers' layers). A hand-written model, FSDP's checkpoint wrapper or a
library calling `torch.utils.checkpoint.checkpoint` itself meets gcpatch only here. A call that an
enable-time decision covers follows that decision (CK4); every other call is decided from exact
facts read from its own arguments: facts -> plugin votes (`gcpatch_call_vote`) -> resolve. The
outcome is cached per pattern of facts, so a training step pays a few attribute reads per call,
and each call site is recorded and logged once.
"""
from __future__ import annotations

import contextvars
import functools
import logging
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from gcpatch import engine, record, resolve, settings
from gcpatch.caller import call_from, user_frame
from gcpatch.errors import GcpatchError
from gcpatch.facts import named_modules
from gcpatch.schema import RUN_INLINE, USE_REENTRANT, USER, CallFacts, Decision, Vote

log = logging.getLogger("gcpatch")

# The keyword arguments `checkpoint` takes for itself; the others go to the checkpointed function.
CHECKPOINT_KWARGS = frozenset(
    {"use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop"})

# How deep the running code is inside checkpointed functions (forward or recompute).
_depth: contextvars.ContextVar[int] = contextvars.ContextVar("gcpatch_checkpoint_depth", default=0)
# Modules whose checkpoint calls an enable-time decision covers, and the model it was made for.
_covered: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_outcomes: dict[tuple, _Outcome] = {}
_reported_sites: set[tuple] = set()


@dataclass(frozen=True)
class _Outcome:
    """What to do with every call that shows one pattern of facts."""

    use_reentrant: bool | None = None  # the value to run with; None: as called
    inline: bool = False  # run the function directly (CK2)
    rules: tuple[str, ...] = ()
    decision: Decision | None = None
    facts: CallFacts | None = None

    @property
    def noteworthy(self) -> bool:
        return bool(self.rules or (self.decision and (self.decision.warnings or self.decision.conflicts)))


_AS_CALLED = _Outcome()


def cover(model: Any) -> None:
    """An enable-time decision now governs the checkpoint calls of `model`'s modules (CK4)."""
    label = type(model).__name__
    for _, module in named_modules(model):
        _covered[module] = label


def uncover(model: Any) -> None:
    for module in model.modules():
        _covered.pop(module, None)


def run(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Run one `checkpoint(function, *args, **kwargs)` call as decided (wrapt's wrapper protocol).
    The hot path: a correct call costs the facts it needs and a dictionary look-up, never a
    plugin call. gcpatch's own failures leave the call as made (one log line); the host's
    exceptions pass through untouched."""
    if not args:
        return original(*args, **kwargs)
    function = args[0]
    try:
        outcome = _outcome_of(function, args, kwargs)
    except GcpatchError:
        raise
    except Exception as exc:
        outcome = _failed_open(exc)
    if outcome is not _AS_CALLED:
        if outcome.inline:
            return function(*args[1:], **{k: v for k, v in kwargs.items() if k not in CHECKPOINT_KWARGS})
        if outcome.use_reentrant is not None:
            kwargs = {**kwargs, USE_REENTRANT: outcome.use_reentrant}
    if USE_REENTRANT not in kwargs:  # torch warns with stacklevel=2: let it name the caller, not gcpatch
        return call_from(user_frame(), original, (_inside_checkpoint(function), *args[1:]), kwargs)
    return original(_inside_checkpoint(function), *args[1:], **kwargs)


def _outcome_of(function: Any, args: tuple, kwargs: dict) -> _Outcome:
    torch = _torch or _bind_torch()
    nested = _depth.get() > 0
    asked = kwargs.get("use_reentrant")
    reentrant = asked is None or bool(asked)
    context = "context_fn" in kwargs and kwargs["context_fn"] is not torch.utils.checkpoint.noop_context_fn
    if not (nested or reentrant):
        return _AS_CALLED  # non-reentrant, not nested: nothing to decide
    grad = torch.is_grad_enabled()
    if not (nested or context or grad):
        return _AS_CALLED
    tensor = torch.Tensor
    inputs_grad = any(isinstance(a, tensor) and a.requires_grad for a in args[1:])
    if not (nested or context or not inputs_grad):
        return _AS_CALLED  # a correct reentrant call
    modules = _modules_in(function, torch.nn.Module)
    if not nested and any(m in _covered for m in modules):
        return _AS_CALLED  # CK4: the enable-time decision stands
    trainable = None if (nested or inputs_grad or not modules) else _any_trainable(modules)
    key = (_as_bool(asked), grad, inputs_grad, trainable, context, nested)
    outcome = _outcomes.get(key) or _decide(key, torch)
    if outcome.noteworthy:
        _report_once(outcome)
    return outcome


_torch: Any = None  # torch, once the first call arrives (the engine may start while torch imports)


def _bind_torch() -> Any:
    global _torch
    _torch = sys.modules["torch"]
    return _torch


def _failed_open(exc: BaseException) -> _Outcome:
    cfg = settings.read()
    if cfg.strict:
        raise GcpatchError(f"deciding a checkpoint call failed: {type(exc).__name__}: {exc}", rule="gcpatch:call",
                           fix="report it, or set GCPATCH_MODE=fix to run such calls as made") from exc
    if ("failed", type(exc).__name__) not in _reported_sites:
        _reported_sites.add(("failed", type(exc).__name__))
        log.error("gcpatch: checkpoint calls left as made, deciding one failed (%s: %s)", type(exc).__name__, exc)
        record.failure("call", f"{type(exc).__name__}: {exc}", cfg.record_dir)
    return _AS_CALLED


def _inside_checkpoint(function: Callable[..., Any]) -> Callable[..., Any]:
    """The checkpointed function, marking that code runs inside a checkpoint (forward and
    recompute alike), so a checkpoint call nested in it is known as such (CK2)."""

    def body(*args: Any, **kwargs: Any) -> Any:
        token = _depth.set(_depth.get() + 1)
        try:
            return function(*args, **kwargs)
        finally:
            _depth.reset(token)

    return body


def _decide(key: tuple, torch: Any) -> _Outcome:
    asked, grad, inputs_grad, trainable, context, nested = key
    facts = CallFacts(asked_use_reentrant=asked, grad_enabled=grad, inputs_require_grad=inputs_grad,
                      trainable_inside=trainable, context_fn=context, nested=nested,
                      torch_version=str(getattr(torch, "__version__", "")))
    cfg = settings.read()
    try:
        votes = [_as_called(facts)] + engine.host().call_votes(facts)
        decision = resolve.resolve(votes, cfg.mode)  # strict mode raises here, and nothing is cached
    except GcpatchError:
        raise
    except Exception as exc:
        _outcomes[key] = _failed_open(exc)  # the same facts would fail again: decided once, as made
        return _AS_CALLED
    changed = decision.values.get(USE_REENTRANT)
    use_reentrant = changed if changed is not None and changed != facts.reentrant else None
    inline = bool(decision.values.get(RUN_INLINE))
    rules = tuple(v.rule for k, v in decision.winners.items()
                  if (k == USE_REENTRANT and use_reentrant is not None) or (k == RUN_INLINE and inline))
    outcome = _Outcome(use_reentrant, inline, rules, decision, facts)
    _outcomes[key] = outcome
    return outcome


def _as_called(facts: CallFacts) -> Vote:
    """The call as the caller made it is the user's vote: a rule that changes it is a conflict,
    resolved by the mode (fix applies the rule, warn keeps the call, strict raises)."""
    how = "asked at the call" if facts.asked_use_reentrant is not None else \
        "torch's default, use_reentrant not passed"
    return Vote(USE_REENTRANT, facts.reentrant, USER, "USER", how, plugin="core")


def _report_once(outcome: _Outcome) -> None:
    frame = user_frame(2)
    where = (frame.f_code, frame.f_lineno) if frame is not None else None
    key = (where, outcome.rules or tuple(outcome.decision.warnings if outcome.decision else ()))
    if key in _reported_sites:
        return
    _reported_sites.add(key)
    applied: dict[str, Any] = {}
    if outcome.use_reentrant is not None:
        applied[USE_REENTRANT] = outcome.use_reentrant
    if outcome.inline:
        applied[RUN_INLINE] = True
    site = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
    record.call_site(site, outcome.facts, outcome.decision, applied, settings.read().record_dir)


def _modules_in(function: Any, module_type: type) -> list[Any]:
    """The modules a checkpointed function runs: the function itself, a bound method's owner,
    a partial's arguments (transformers 5.x: `partial(forward, layer)`), a closure's cells
    (FSDP's reentrant wrapper, hand-written `custom_forward`s)."""
    found: list[Any] = []
    pending = [function]
    for _ in range(16):  # bounded: a pathological closure must not cost more than a few reads
        if not pending:
            break
        item = pending.pop()
        if isinstance(item, module_type):
            found.append(item)
        elif isinstance(item, functools.partial):
            pending.append(item.func)
            pending.extend(item.args)
        else:
            owner = getattr(item, "__self__", None)
            if owner is not None:
                pending.append(owner)
            for cell in getattr(getattr(item, "__func__", item), "__closure__", None) or ():
                try:
                    pending.append(cell.cell_contents)
                except ValueError:  # an empty cell: nothing bound there yet
                    continue
    return found


def _any_trainable(modules: list[Any]) -> bool:
    return any(_trainable(m) for m in modules)


def _trainable(module: Any) -> bool:
    """Whether any parameter of `module` or its children requires grad: the registries read
    directly, as `parameters()`' generator costs several times more on the hot path."""
    for param in module._parameters.values():
        if param is not None and param.requires_grad:
            return True
    return any(child is not None and _trainable(child) for child in module._modules.values())


def _as_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def reset() -> None:
    """Forget cached outcomes and reported sites (a re-activation, tests)."""
    _outcomes.clear()
    _reported_sites.clear()
