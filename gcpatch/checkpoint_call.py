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
from dataclasses import dataclass, replace
from typing import Any, Callable

import wrapt

from gcpatch import engine, patching, record, reentrant_grads, resolve, settings
from gcpatch.caller import call_from, user_frame
from gcpatch.errors import GcpatchError
from gcpatch.facts import named_modules
from gcpatch.schema import (
    DEFAULT,
    LIFT_BOUND_TENSORS,
    REQUIRED,
    RUN_INLINE,
    USE_REENTRANT,
    USER,
    CallFacts,
    Decision,
    Vote,
)

log = logging.getLogger("gcpatch")

# The keyword arguments `checkpoint` takes for itself; the others go to the checkpointed function.
CHECKPOINT_KWARGS = frozenset(
    {
        "use_reentrant",
        "preserve_rng_state",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
    }
)

# How deep the running code is inside checkpointed functions (forward or recompute).
_depth: contextvars.ContextVar[int] = contextvars.ContextVar("gcpatch_checkpoint_depth", default=0)
# Modules whose checkpoint calls an enable-time decision covers, and the model it was made for.
_covered: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()
_outcomes: dict[tuple, _Outcome] = {}
_reported_sites: set[tuple] = set()


@dataclass(frozen=True)
class _Outcome:
    """What to do with every call that shows one pattern of facts."""

    use_reentrant: bool | None = None  # the value to run with; None: as called
    inline: bool = False  # run the function directly (CK2)
    lift: bool = False  # pass the partial's bound graph tensors as positional inputs (CK5)
    rules: tuple[str, ...] = ()
    decision: Decision | None = None
    facts: CallFacts | None = None

    @property
    def noteworthy(self) -> bool:
        return bool(
            self.rules or (self.decision and (self.decision.warnings or self.decision.conflicts))
        )


_AS_CALLED = _Outcome()


def cover(model: Any, decision: Decision | None = None) -> None:
    """An enable-time decision now governs the checkpoint calls of `model`'s modules (CK4): at
    each call it is the standing vote, which only the call's own evidence (CK1, CK5) outranks."""
    winner = decision.winners.get(USE_REENTRANT) if decision is not None else None
    standing = (
        (
            type(model).__name__,
            winner.rule,
            str(winner.strength),
            winner.avoids,
            winner.short or winner.reason,
        )
        if winner is not None
        else (type(model).__name__, "DEFAULT", DEFAULT, "", "")
    )
    for _, module in named_modules(model):
        _covered[module] = standing


def uncover(model: Any) -> None:
    for module in model.modules():
        _covered.pop(module, None)


def run(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Run one `checkpoint(function, *args, **kwargs)` call as decided (wrapt's wrapper protocol).
    The hot path: a correct call costs the facts it needs and a dictionary look-up, never a
    plugin call. gcpatch's own failures leave the call as made (one log line); the host's
    exceptions pass through untouched."""
    if not args or _compiling():
        return original(*args, **kwargs)
    function = args[0]
    try:
        outcome = _outcome_of(function, args, kwargs)
    except GcpatchError:
        raise
    except Exception as exc:  # noqa: BLE001 (fail open: the call runs as made, one line)
        outcome = _failed_open(exc)
    if outcome is not _AS_CALLED:
        if outcome.inline:
            return function(
                *args[1:], **{k: v for k, v in kwargs.items() if k not in CHECKPOINT_KWARGS}
            )
        if outcome.use_reentrant is not None:
            kwargs = {**kwargs, USE_REENTRANT: outcome.use_reentrant}
        elif outcome.lift:
            function, rest = _lift(function, args, _torch)
            args = (function, *rest)
    if kwargs.get(USE_REENTRANT, True) is not False:
        reentrant_grads.reentrant_ran()  # CK6 looks at graphs only once a reentrant checkpoint ran
    if (
        USE_REENTRANT not in kwargs
    ):  # torch warns with stacklevel=2: let it name the caller, not gcpatch
        return call_from(user_frame(), original, (_inside_checkpoint(function), *args[1:]), kwargs)
    return original(_inside_checkpoint(function), *args[1:], **kwargs)


def _eager_under_dynamo(eval_frame: Any) -> None:
    """Post-import hook of `torch._dynamo.eval_frame`: the decision's own frames (the patch point's
    wrapper, `run`, the checkpointed function's marker) run eagerly when torch.compile meets them as
    fresh frames, as it does torch's own `checkpoint` frame. A compiled frame given back to eager
    (FSDP2's hooks, transformers 4.x's logging) then calls them eagerly, gcpatch decides as usual,
    and dynamo goes on with the checkpointed function's frames as without gcpatch, instead of
    tracing gcpatch's frames into its checkpoint operator and breaking there once more per layer.
    Inlined into a frame dynamo traces, they are traced as before (a skipped code object is only
    skipped as a fresh frame)."""
    skip_code = getattr(eval_frame, "skip_code", None)
    if skip_code is None:
        log.info(
            "gcpatch: this torch's dynamo has no skip_code; a checkpoint call in a frame"
            " torch.compile gives back to eager may add a graph break"
        )
        return
    try:
        for code in (
            patching.FUNCTION_WRAPPER_CODE,
            run.__code__,
            _inside_checkpoint(len).__code__,
        ):
            skip_code(code)
    except Exception as exc:  # noqa: BLE001 - inside the host's import of torch._dynamo: never raise there
        log.warning(
            "gcpatch: could not mark its checkpoint frames for torch.compile (%s: %s); a checkpoint"
            " call in a frame torch.compile gives back to eager may add a graph break",
            type(exc).__name__,
            exc,
        )


def _compiling() -> bool:
    """torch.compile is tracing this call: it runs as called, so nothing here breaks the graph (the
    context variable, frame walks, the caches). Dynamo turns the call into its checkpoint operator,
    which recomputes inside the compiled backward whatever use_reentrant says: the inputs that need
    no gradient cannot cost a layer its gradients there (CK1's failure is eager reentrant's own).
    A frame dynamo gives back to eager runs this wrapper eagerly, and is decided as usual."""
    torch = _torch or _bind_torch()
    return torch.compiler.is_compiling()


def _outcome_of(function: Any, args: tuple, kwargs: dict) -> _Outcome:
    torch = _torch or _bind_torch()
    nested = _depth.get() > 0
    asked = kwargs.get("use_reentrant")
    reentrant = asked is None or bool(asked)
    context = (
        "context_fn" in kwargs
        and kwargs["context_fn"] is not torch.utils.checkpoint.noop_context_fn
    )
    if not (nested or reentrant):
        return _AS_CALLED  # non-reentrant, not nested: nothing to decide
    grad = torch.is_grad_enabled()
    if not (nested or context or grad):
        return _AS_CALLED
    tensor = torch.Tensor
    inputs_grad = any(isinstance(a, tensor) and a.requires_grad for a in args[1:])
    if (
        inputs_grad
        and not (nested or context)
        and not _binds_graph_tensors(function, tensor, torch.nn.Module)
    ):
        return _AS_CALLED  # a correct reentrant call: nothing bound into it has a graph of its own
    reach = _reach(function, torch)
    covered = None if nested else next((_covered[m] for m in reach.modules if m in _covered), None)
    if nested or inputs_grad:
        trainable = None
    elif reach.bound_grad or _any_trainable(reach.modules):
        trainable = True
    else:
        trainable = (
            False if reach.modules else None
        )  # no module reached: what it uses cannot be known
    key = (
        _as_bool(asked),
        grad,
        inputs_grad,
        trainable,
        context,
        nested,
        reach.graph_tensors,
        reach.liftable,
        covered,
    )
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
        raise GcpatchError(
            f"deciding a checkpoint call failed: {type(exc).__name__}: {exc}",
            rule="gcpatch:call",
            fix="report it, or set GCPATCH_MODE=fix to run such calls as made",
        ) from exc
    if ("failed", type(exc).__name__) not in _reported_sites:
        _reported_sites.add(("failed", type(exc).__name__))
        log.error(
            "gcpatch: checkpoint calls left as made, deciding one failed (%s: %s)",
            type(exc).__name__,
            exc,
        )
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
    asked, grad, inputs_grad, trainable, context, nested, graph, liftable, covered = key
    facts = CallFacts(
        asked_use_reentrant=asked,
        grad_enabled=grad,
        inputs_require_grad=inputs_grad,
        trainable_inside=trainable,
        context_fn=context,
        nested=nested,
        bound_graph_tensors=graph,
        bound_graph_liftable=liftable,
        enable_decision=covered[1] if covered else "",
        torch_version=str(getattr(torch, "__version__", "")),
    )
    cfg = settings.read()
    try:
        votes = [_standing(facts, covered)] + engine.host().call_votes(facts)
        decision = resolve.resolve(
            votes, cfg.mode
        )  # strict mode raises here, and nothing is cached
    except GcpatchError:
        raise
    except Exception as exc:  # noqa: BLE001 (fail open: decided once, as made)
        _outcomes[key] = _failed_open(exc)  # the same facts would fail again: decided once, as made
        return _AS_CALLED
    changed = decision.values.get(USE_REENTRANT)
    use_reentrant = changed if changed is not None and changed != facts.reentrant else None
    inline = bool(decision.values.get(RUN_INLINE))
    lift = (
        bool(decision.values.get(LIFT_BOUND_TENSORS)) and use_reentrant is None and facts.reentrant
    )
    applied = {
        USE_REENTRANT: use_reentrant is not None,
        RUN_INLINE: inline,
        LIFT_BOUND_TENSORS: lift,
    }
    rules = tuple(v.rule for k, v in decision.winners.items() if applied.get(k))
    if covered and use_reentrant is not None:
        _say_evidence_won(decision, covered)
    outcome = _Outcome(use_reentrant, inline, lift, rules, decision, facts)
    _outcomes[key] = outcome
    return outcome


def _standing(facts: CallFacts, covered: tuple | None) -> Vote:
    """The vote the call stands on: the enable-time decision that covers its module (with that
    decision's rule and strength: a user's ask stays the user's, R3's required reentrant stays
    required), else the call as the caller made it, which is the user's vote. A rule that changes
    it is a conflict resolved by the mode (fix applies the rule, warn keeps the call, strict
    raises).
    """
    if covered:
        model, rule, strength, avoids, why = covered
        return Vote(
            USE_REENTRANT,
            facts.reentrant,
            strength,
            rule,
            f"decided at enable time for {model} ({why})",
            plugin="core",
            avoids=avoids if strength == REQUIRED else "",
            short=why,
        )
    how = (
        "asked at the call"
        if facts.asked_use_reentrant is not None
        else "torch's default, use_reentrant not passed"
    )
    return Vote(USE_REENTRANT, facts.reentrant, USER, "USER", how, plugin="core")


def _say_evidence_won(decision: Decision, covered: tuple) -> None:
    """The call's own evidence outranked the enable-time decision: the line and the record say
    which evidence overrode which rule."""
    model, rule = covered[0], covered[1]
    winner = decision.winners[USE_REENTRANT]
    decision.winners[USE_REENTRANT] = replace(
        winner,
        short=f"evidence over {rule} at enable; {winner.short or winner.reason}",
        reason=(
            f"{winner.reason} (evidence at the call: it overrides {rule}, which decided"
            f" use_reentrant=True for {model} at enable time)"
        ),
    )


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
    if outcome.lift:
        applied[LIFT_BOUND_TENSORS] = True
    site = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
    record.call_site(site, outcome.facts, outcome.decision, applied, settings.read().record_dir)


@dataclass(frozen=True)
class _Reach:
    """What a checkpointed function holds besides its positional inputs."""

    modules: tuple[Any, ...] = ()
    bound_grad: bool = (
        False  # a tensor that requires grad is bound (partial, closure, default argument)
    )
    graph_tensors: int = 0  # ... of which this many have a graph of their own (not leaves)
    # every such tensor is an argument of the partial itself (CK5 can pass it positionally)
    liftable: bool = False


_NOTHING = _Reach()


def _reach(function: Any, torch: Any) -> _Reach:
    """The modules and grad-requiring tensors a checkpointed function runs with besides its
    positional inputs: the function itself, a bound method's owner, a partial's arguments and
    keywords (transformers: `partial(forward, layer, **kwargs)`), closure cells (FSDP's reentrant
    wrapper, hand-written `custom_forward`s) and default arguments. Bounded: a pathological closure
    costs a few reads, never a walk of the program."""
    tensor, module_type = torch.Tensor, torch.nn.Module
    modules: list[Any] = []
    bound_grad = False
    graph = lifted = 0
    pending: list[tuple[Any, bool]] = [(function, False)]  # (item, an argument of the top partial)
    for _ in range(24):
        if not pending:
            break
        item, top = pending.pop()
        if isinstance(item, tensor):
            if item.requires_grad:
                bound_grad = True
                if item.grad_fn is not None:
                    graph += 1
                    lifted += top
        elif isinstance(item, module_type):
            modules.append(item)
        elif isinstance(item, functools.partial):
            first = item is function
            pending.append((item.func, False))
            pending.extend((a, first) for a in item.args)
            pending.extend((v, first) for v in item.keywords.values())
        elif isinstance(item, (tuple, list)):
            pending.extend((v, False) for v in item[:8])
        elif callable(item):
            owner = getattr(item, "__self__", None)
            if owner is not None:
                pending.append((owner, False))
            code = getattr(item, "__func__", item)
            for cell in getattr(code, "__closure__", None) or ():
                try:
                    pending.append((cell.cell_contents, False))
                except ValueError:  # an empty cell: nothing bound there yet
                    continue
            pending.extend((d, False) for d in getattr(code, "__defaults__", None) or ())
            pending.extend(
                (d, False) for d in (getattr(code, "__kwdefaults__", None) or {}).values()
            )
    if not (modules or bound_grad):
        return _NOTHING
    return _Reach(tuple(modules), bound_grad, graph, bool(graph) and lifted == graph)


def _binds_graph_tensors(function: Any, tensor: type, module_type: type) -> bool:
    """The hot path's question for a correct reentrant call (CK5): does a tensor with a graph reach
    the function other than positionally? Read one level deep, building nothing: a partial's
    arguments and keywords (and tuples among them: transformers' `position_embeddings`), or a
    function's closure cells and default arguments (a per-call closure, `def run(h=h)`). `_reach`
    looks deeper once a call is off the hot path."""
    if type(function) is functools.partial:
        return _has_graph(function.keywords.values(), tensor) or _has_graph(function.args, tensor)
    if isinstance(
        function, module_type
    ):  # its attributes are not read (nn.Module.__getattr__ is slow)
        return False
    code = getattr(function, "__func__", function)
    cells = []
    for cell in getattr(code, "__closure__", None) or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return _has_graph(cells, tensor) or _has_graph(
        getattr(code, "__defaults__", None) or (), tensor
    )


def _has_graph(values: Any, tensor: type) -> bool:
    for value in values:
        if isinstance(value, tensor):
            if value.grad_fn is not None:
                return True
        elif type(value) is tuple:
            for item in value:
                if isinstance(item, tensor) and item.grad_fn is not None:
                    return True
    return False


def _lift(function: Any, args: tuple, torch: Any) -> tuple[Any, tuple]:
    """CK5: the partial's grad-requiring tensors that have a graph become positional inputs of the
    checkpoint, so reentrant backward returns their gradients through the caller's graph instead of
    running that graph inside its own backward. Returns the function and the checkpoint's
    positional arguments after it."""
    tensor = torch.Tensor
    params = list(function.args)
    keywords = dict(function.keywords)
    slots = [
        i
        for i, a in enumerate(params)
        if isinstance(a, tensor) and a.requires_grad and a.grad_fn is not None
    ]
    names = [
        k
        for k, v in keywords.items()
        if isinstance(v, tensor) and v.requires_grad and v.grad_fn is not None
    ]
    moved = tuple(params[i] for i in slots) + tuple(keywords[k] for k in names)
    count = len(args) - 1
    inner = function.func

    def lifted(*inputs: Any) -> Any:
        given, values = inputs[:count], inputs[count:]
        call_params, call_keywords = list(params), dict(keywords)
        for i, value in zip(slots, values):
            call_params[i] = value
        for name, value in zip(names, values[len(slots) :]):
            call_keywords[name] = value
        return inner(*call_params, *given, **call_keywords)

    return lifted, (*args[1:], *moved)


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


wrapt.register_post_import_hook(_eager_under_dynamo, "torch._dynamo.eval_frame")
