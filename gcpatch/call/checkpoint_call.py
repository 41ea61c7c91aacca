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
import importlib
import logging
import sys
import weakref
from dataclasses import replace
from typing import Any, Callable

from gcpatch import engine, import_hooks, lifetime, patching, record, resolve, settings
from gcpatch.call import call_facts, call_rewrites, curried_call, reentrant_grads
from gcpatch.call.call_facts import TRACKED
from gcpatch.call.caller import call_from, user_frame
from gcpatch.errors import GcpatchError
from gcpatch.facts import as_bool, named_modules
from gcpatch.schema import (
    DEFAULT,
    GRAD_INPUT,
    INPUT_GRADS_HOOK,
    LIFT_BOUND_TENSORS,
    REQUIRED,
    RUN_INLINE,
    TUPLE_OUTPUTS,
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
        "respect_saved_tensors_hooks",
    }
)

# How deep the running code is inside checkpointed functions (forward or recompute).
_depth: contextvars.ContextVar[int] = contextvars.ContextVar("gcpatch_checkpoint_depth", default=0)
# Modules whose checkpoint calls an enable-time decision covers, and the model it was made for.
_covered: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()
_outcomes: dict[tuple, _Outcome] = {}
_reported_sites: set[tuple] = set()
# Functions (call_facts.code_key) whose first reentrant result was looked at, and what those whose
# result reentrant could not track returned (CK7).
_probed: set[Any] = set()
_untracked: dict[Any, str] = {}


class _Outcome:
    """What to do with every call that shows one pattern of facts."""

    __slots__ = (
        "use_reentrant",
        "inline",
        "lift",
        "grad_input",
        "tuple_outputs",
        "rules",
        "decision",
        "facts",
    )

    def __init__(
        self,
        use_reentrant: bool | None = None,  # the value to run with; None: as called
        inline: bool = False,  # run the function directly (CK2)
        lift: bool = False,  # pass the partial's bound graph tensors as positional inputs (CK5)
        grad_input: bool = False,  # one more input that requires grad, reentrant kept (CK1)
        tuple_outputs: bool = False,  # the result through the checkpoint as a flat tuple (CK7)
        rules: tuple[str, ...] = (),
        decision: Decision | None = None,
        facts: CallFacts | None = None,
    ) -> None:
        self.use_reentrant, self.inline, self.lift = use_reentrant, inline, lift
        self.grad_input, self.tuple_outputs, self.rules = grad_input, tuple_outputs, rules
        self.decision, self.facts = decision, facts

    @property
    def noteworthy(self) -> bool:
        return bool(
            self.rules or (self.decision and (self.decision.warnings or self.decision.conflicts))
        )


_AS_CALLED = _Outcome()


class Counted:
    """A checkpointed function whose runs verify counts (gcpatch/step/verify.py). The call is
    decided on `function` itself, as the user's step shows it (a wrapper would hide a partial's
    bound tensors), the count is taken inside the checkpoint after any rewrite, forward and
    recompute alike, and `rules` keeps what the call rules changed ({rule: short reason}) for
    verify's line. Called as it is where gcpatch does not decide (not active, compile tracing)."""

    __slots__ = ("function", "count", "rules")

    def __init__(self, function: Callable[..., Any], count: Callable[[], None]) -> None:
        self.function, self.count = function, count
        self.rules: dict[str, str] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.count()
        return self.function(*args, **kwargs)

    def took(self, outcome: _Outcome) -> None:
        winners = outcome.decision.winners if outcome.decision is not None else {}
        for vote in winners.values():
            if vote.rule in outcome.rules:
                self.rules.setdefault(vote.rule, vote.short or vote.reason)


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
    # the input-grads hook strict mode withheld (gcpatch/apply.py): the call it would serve names it
    hook = decision.winners.get(INPUT_GRADS_HOOK) if decision is not None else None
    withheld = decision is not None and decision.mode == "strict" and hook is not None
    standing += (hook if withheld and hook.value else None,)
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
    if _compiling() or (not args and "function" in kwargs):
        return original(*args, **kwargs)
    if not args:  # checkpoint(**options)(function): torch 2.14's curried form
        return curried_call.curry(original, kwargs, CHECKPOINT_KWARGS)
    function, counted = args[0], None
    if type(function) is Counted:  # verify's checked pass: decided on the user's function
        counted, function = function, function.function
        args = (function, *args[1:])
    key = None
    try:
        asked = kwargs.get(USE_REENTRANT)
        if asked is None or asked:  # what a reentrant call's function returned is kept by its key
            key = call_facts.code_key(function)
        untracked = _untracked.get(key, TRACKED) if _untracked and key is not None else TRACKED
        outcome = _outcome_of(function, args, kwargs, untracked)
    except GcpatchError as exc:  # strict mode: its traceback starts at this, the user's call
        raise exc.with_traceback(None) from exc.__cause__
    except Exception as exc:  # noqa: BLE001 (fail open: the call runs as made, one line)
        key, outcome = None, _failed_open(exc)
    count = None
    if counted is not None:
        counted.took(outcome)
        count = counted.count
    if outcome.inline:
        inner = {k: v for k, v in kwargs.items() if k not in CHECKPOINT_KWARGS}
        return (counted or function)(*args[1:], **inner)
    decided = outcome.use_reentrant
    runs_reentrant = (
        decided if decided is not None else kwargs.get(USE_REENTRANT, True) is not False
    )
    if runs_reentrant and key is not None and _torch.is_grad_enabled():
        return _checked_result(original, args, kwargs, outcome, key, count)
    return _checkpoint(original, args, kwargs, outcome, count)


def _checkpoint(
    original: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    outcome: _Outcome,
    count: Callable[[], None] | None = None,
) -> Any:
    """torch's checkpoint, called as `outcome` says: use_reentrant, and the rewrites that keep a
    reentrant call exact (call_rewrites.py). `count` is verify's, called at each run."""
    function, rest = args[0], args[1:]
    if outcome.use_reentrant is not None:
        kwargs = {**kwargs, USE_REENTRANT: outcome.use_reentrant}
    elif outcome.lift:
        function, rest = call_rewrites.lift(function, args, _torch.Tensor)
    elif outcome.grad_input:
        function, rest = call_rewrites.with_grad_input(function, rest, _torch)
    rebuild = None
    if outcome.tuple_outputs:
        function, rebuild = call_rewrites.as_tuple(function, _pytree())
    if kwargs.get(USE_REENTRANT, True) is not False:
        reentrant_grads.reentrant_ran()  # CK6 looks at graphs only once a reentrant checkpoint ran
    if (
        USE_REENTRANT not in kwargs
    ):  # torch warns with stacklevel=2: it names the caller, not gcpatch
        result = call_from(
            user_frame(), original, (_inside_checkpoint(function, count), *rest), kwargs
        )
    else:
        result = original(_inside_checkpoint(function, count), *rest, **kwargs)
    return result if rebuild is None else rebuild(result)


def _checked_result(
    original: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    outcome: _Outcome,
    key: Any,
    count: Callable[[], None] | None = None,
) -> Any:
    """A reentrant call's result shows whether reentrant could track it (CK7: tensors inside a
    dict, list or ModelOutput come back without a graph). Where it could not, the call is decided
    again with that fact and run again as decided: the forward the step keeps is the second, the
    first left no graph. A function's first call starts from an RNG snapshot, so its second run
    draws what the first drew (dropout); a later call whose result changed shape runs again from
    where the first left the RNG, and the record says so."""
    restore = None
    if key not in _probed:
        _probed.add(key)
        restore = call_rewrites.rng_snapshot(_torch, args[1:])
    result = _checkpoint(original, args, kwargs, outcome, count)
    if outcome.tuple_outputs or call_facts.tracked_quickly(result, _torch.Tensor):
        return result
    try:
        seen = call_facts.untracked_outputs(result, _torch.Tensor, _pytree())
        if seen == TRACKED:
            return result
        _untracked[key] = seen
        again = _outcome_of(args[0], args, kwargs, seen)
    except GcpatchError:
        raise
    except Exception as exc:  # noqa: BLE001 (fail open: the first result stands, one line)
        _failed_open(exc)
        return result
    if again is outcome or again.inline:
        return result
    del result
    if restore is not None:
        restore()
    else:
        _say_rng_not_rewound(args[0])
    return _checkpoint(original, args, kwargs, again, count)


def _say_rng_not_rewound(function: Any) -> None:
    name = getattr(function, "__qualname__", type(function).__name__)
    if ("rng", name) in _reported_sites:
        return
    _reported_sites.add(("rng", name))
    text = (
        f"gcpatch: a checkpoint call of {name} returned tensors reentrant cannot track after"
        " earlier calls of it did not; it ran again as decided (CK7) without its RNG snapshot, so"
        " a dropout mask of that call may differ from a plain run's"
    )
    log.info("%s", text)
    record.event({"stage": "call", "line": text, "rule": "CK7"}, settings.read().record_dir)


def _pytree() -> Any:
    return sys.modules.get("torch.utils._pytree") or importlib.import_module("torch.utils._pytree")


def _eager_under_dynamo(eval_frame: Any) -> None:
    """Post-import hook of `torch._dynamo.eval_frame`: the decision's own frames (the patch point's
    wrapper and guard, `run`, the checkpointed function's marker) run eagerly when torch.compile
    meets them as fresh frames, as it does torch's own `checkpoint` frame. A compiled frame given
    back to eager (FSDP2's hooks, transformers 4.x's logging) then calls them eagerly, gcpatch
    decides as usual, and dynamo goes on with the checkpointed function's frames as without
    gcpatch, instead of tracing gcpatch's frames into its checkpoint operator and breaking there
    once more per layer. Inlined into a frame dynamo traces, they are traced as before (a skipped
    code object is only skipped as a fresh frame). A fresh `run` runs eagerly with every frame it
    calls, as torch's own checkpoint does (`torch._disable_dynamo`): traced as fresh frames, its
    decision's helpers broke at the decision's context variable (transformers 5.2's compiled FSDP2
    step: one graph break more than plain) and its RNG snapshot compiled graphs of its own."""
    skip_code = getattr(eval_frame, "skip_code", None)
    if skip_code is None:
        log.info(
            "gcpatch: this torch's dynamo has no skip_code; a checkpoint call in a frame"
            " torch.compile gives back to eager may add a graph break"
        )
        return
    try:
        for code in (
            *patching.GUARD_CODES,
            _checkpoint.__code__,
            _checked_result.__code__,
            _inside_checkpoint(len).__code__,
            *call_rewrites.codes(),
        ):
            skip_code(code)
        (_skipper_with_callees(eval_frame) or skip_code)(run.__code__)
    except Exception as exc:  # noqa: BLE001 - inside the host's import of torch._dynamo: never raise there
        log.warning(
            "gcpatch: could not mark its checkpoint frames for torch.compile (%s: %s); a checkpoint"
            " call in a frame torch.compile gives back to eager may add a graph break",
            type(exc).__name__,
            exc,
        )


def _skipper_with_callees(eval_frame: Any) -> Callable[[Any], None] | None:
    """Dynamo's strategy that skips a code object's fresh frames and every frame they call
    (torch._dynamo.types' FrameExecStrategy), or None where this torch has none."""
    kinds = sys.modules.get("torch._dynamo.types")
    strategy = getattr(kinds, "FrameExecStrategy", None)
    action = getattr(kinds, "FrameAction", None)
    set_strategy = getattr(eval_frame, "set_code_exec_strategy", None)
    if strategy is None or action is None or set_strategy is None:
        return None
    return lambda code: set_strategy(code, strategy(action.SKIP, action.SKIP))


def _compiling() -> bool:
    """torch.compile is tracing this call: it runs as called, so nothing here breaks the graph (the
    context variable, frame walks, the caches). Dynamo turns the call into its checkpoint operator,
    which recomputes inside the compiled backward whatever use_reentrant says: the inputs that need
    no gradient cannot cost a layer its gradients there (CK1's failure is eager reentrant's own).
    A frame dynamo gives back to eager runs this wrapper eagerly, and is decided as usual."""
    torch = _torch or _bind_torch()
    return torch.compiler.is_compiling()


def _outcome_of(function: Any, args: tuple, kwargs: dict, untracked: str) -> _Outcome:
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
    tensor, rest = torch.Tensor, args[1:]
    inputs_grad = any(isinstance(a, tensor) and a.requires_grad for a in rest)
    if (
        inputs_grad
        and not (nested or context or untracked)
        and not call_facts.binds_graph_tensors(function, tensor, torch.nn.Module)
        and not call_facts.containers_hold_graph(rest, tensor)
    ):
        return _AS_CALLED  # a correct reentrant call: nothing it gets has a graph reentrant misses
    reach = call_facts.reach(function, tensor, torch.nn.Module)
    in_containers, container_graph = call_facts.in_containers(rest, tensor)
    covered = None if nested else next((_covered[m] for m in reach.modules if m in _covered), None)
    if nested or inputs_grad:
        trainable = None
    elif reach.bound_grad or in_containers or call_facts.any_trainable(reach.modules):
        trainable = True
    else:  # no module reached: what it uses cannot be known
        trainable = False if reach.modules else None
    key = (
        as_bool(asked),
        grad,
        inputs_grad,
        trainable,
        context,
        nested,
        reach.graph_tensors,
        reach.liftable,
        covered,
        container_graph,
        untracked,
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


def _inside_checkpoint(
    function: Callable[..., Any], count: Callable[[], None] | None = None
) -> Callable[..., Any]:
    """The checkpointed function, marking that code runs inside a checkpoint (forward and
    recompute alike), so a checkpoint call nested in it is known as such (CK2); `count`: verify's
    count of the block's runs (`Counted`)."""

    def body(*args: Any, **kwargs: Any) -> Any:
        if count is not None:
            count()
        token = _depth.set(_depth.get() + 1)
        try:
            return function(*args, **kwargs)
        finally:
            _depth.reset(token)

    return body


def _decide(key: tuple, torch: Any) -> _Outcome:
    asked, grad, inputs_grad, trainable, context, nested, graph, liftable, covered = key[:9]
    container_graph, untracked = key[9:]
    facts = CallFacts(
        asked_use_reentrant=asked,
        grad_enabled=grad,
        inputs_require_grad=inputs_grad,
        trainable_inside=trainable,
        context_fn=context,
        nested=nested,
        bound_graph_tensors=graph,
        bound_graph_liftable=liftable,
        container_graph_tensors=container_graph,
        outputs_untracked=untracked,
        enable_decision=covered[1] if covered else "",
        torch_version=str(getattr(torch, "__version__", "")),
    )
    cfg = settings.read()
    try:
        votes = [_standing(facts, covered)] + engine.host().call_votes(facts)
        # strict mode raises here, and nothing is cached
        decision = resolve.resolve(votes, cfg.mode)
    except GcpatchError:
        raise
    except Exception as exc:  # noqa: BLE001 (fail open: the same facts would fail again)
        _outcomes[key] = _failed_open(exc)
        return _AS_CALLED
    values = decision.values
    changed = values.get(USE_REENTRANT)
    use_reentrant = changed if changed is not None and changed != facts.reentrant else None
    kept = use_reentrant is None and facts.reentrant  # reentrant stays: its rewrites apply
    inline = bool(values.get(RUN_INLINE))
    lift = kept and bool(values.get(LIFT_BOUND_TENSORS))
    grad_input = kept and not lift and bool(values.get(GRAD_INPUT))
    tuple_outputs = kept and bool(values.get(TUPLE_OUTPUTS))
    applied = {
        USE_REENTRANT: use_reentrant is not None,
        RUN_INLINE: inline,
        LIFT_BOUND_TENSORS: lift,
        GRAD_INPUT: grad_input,
        TUPLE_OUTPUTS: tuple_outputs,
    }
    rules = tuple(dict.fromkeys(v.rule for k, v in decision.winners.items() if applied.get(k)))
    if cfg.strict:  # strict mode changes nothing on its own: a rewrite raises, nothing is cached
        _refuse_rewrites(decision, applied, covered)
    if covered and use_reentrant is not None:
        _say_evidence_won(decision, covered)
    outcome = _Outcome(
        use_reentrant, inline, lift, grad_input, tuple_outputs, rules, decision, facts
    )
    _outcomes[key] = outcome
    return outcome


def _refuse_rewrites(decision: Decision, applied: dict, covered: tuple | None) -> None:
    """Strict mode where fix mode would rewrite the call to keep its reentrant exact (CK1, CK5,
    CK7): the rule, the rewrite, the user's fix. An input that requires grad, on a call from a
    model whose input-grads hook strict mode withheld (R2, P1, R3), is that hook's to name."""
    for knob in (GRAD_INPUT, LIFT_BOUND_TENSORS, TUPLE_OUTPUTS):
        if not applied.get(knob):
            continue
        vote = decision.winners[knob]
        hook = covered[5] if covered and len(covered) > 5 else None
        if knob == GRAD_INPUT and hook is not None:
            raise resolve.refusal(
                hook,
                because=f"{hook.short or hook.reason}, and a reentrant checkpoint call of"
                f" {covered[0]}'s layers gets no input that requires grad ({vote.rule}): their"
                " parameters would get no gradient",
            )
        raise resolve.refusal(vote)


def _standing(facts: CallFacts, covered: tuple | None) -> Vote:
    """The vote the call stands on: the enable-time decision that covers its module (with that
    decision's rule and strength: a user's ask stays the user's, R3's required reentrant stays
    required), else the call as the caller made it, which is the user's vote. A rule that changes
    it is a conflict resolved by the mode (fix applies the rule, warn keeps the call, strict
    raises).
    """
    if covered:
        model, rule, strength, avoids, why = covered[:5]
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
    if outcome.grad_input:
        applied[GRAD_INPUT] = True
    if outcome.tuple_outputs:
        applied[TUPLE_OUTPUTS] = True
    site = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
    record.call_site(site, outcome.facts, outcome.decision, applied, settings.read().record_dir)


@lifetime.activation
def reset() -> None:
    """Forget covered modules, cached outcomes, reported sites and what results showed."""
    _covered.clear()
    _outcomes.clear()
    _reported_sites.clear()
    _probed.clear()
    _untracked.clear()


import_hooks.when_imported("torch._dynamo.eval_frame", _eager_under_dynamo)
