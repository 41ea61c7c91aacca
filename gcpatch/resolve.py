"""Resolving votes into one decision (docs/HOW-IT-WORKS.md, "Votes").

Per knob the strongest vote wins: required > user > recommended > default. A recommendation the
user's explicit ask overrules is only recorded, or told where it names a cost the ask pays
(`kept_cost`). A required vote against the user's explicit choice wins in fix mode, loses in warn
mode (both with a warning) and raises in strict mode; required votes that disagree go to the worse
failure avoided. Strict mode changes nothing itself: R5 and CK2 raise here, other changes where
they take effect (`refusal`). The outcome never depends on plugin order: votes are taken in a
canonical order, and a tie goes to the value PyTorch recommends for the knob (use_reentrant=False,
torch.utils.checkpoint docs), else to the lowest rule id's; the record says it was a tie.
"""

from __future__ import annotations

from types import MappingProxyType

from gcpatch.errors import GcpatchError
from gcpatch.schema import (
    DEFAULT,
    EVAL_MODE_FIX,
    FAILURE_ORDER,
    GRAD_INPUT,
    INPUT_GRADS_HOOK,
    KNOBS,
    LIFT_BOUND_TENSORS,
    REQUIRED,
    RUN_INLINE,
    STRENGTH_ORDER,
    TUPLE_OUTPUTS,
    USE_REENTRANT,
    USER,
    Decision,
    Facts,
    Stage,
    Vote,
)

# Knobs about how the user's own code runs rather than a checkpoint argument: warn mode only
# warns about them and strict mode raises (R5, CK2).
_STATE_KNOBS = (EVAL_MODE_FIX, RUN_INLINE)

# Strict mode's refusals: per knob, what fix mode would change and what the user does instead
# (read-only); a rewrite's vote describes the rewrite, so `PROBLEMS` says what it answers.
PROBLEMS = MappingProxyType(
    {
        GRAD_INPUT: "no input of this reentrant checkpoint call requires grad: the trainable"
        " parameters inside would get no gradient",
        LIFT_BOUND_TENSORS: "tensors with a graph reach this reentrant checkpoint call's function"
        " other than as positional inputs (a partial's arguments or keywords, closure cells,"
        " default arguments), which reentrant does not see: their gradients are lost, or their"
        " graph is run a second time in backward",
        TUPLE_OUTPUTS: "the checkpointed function returns tensors inside a dict, list or"
        " ModelOutput, which reentrant returns without a graph: everything before them would get"
        " no gradient",
    }
)
CHANGES = MappingProxyType(
    {
        EVAL_MODE_FIX: (
            "make the checkpointed layers left in eval mode checkpoint anyway (their `training`"
            " flag set in forwards that build a graph)",
            "call model.train() before the training step",
        ),
        RUN_INLINE: (
            "run this checkpoint call's function directly, as the checkpoint around it already"
            " recomputes it",
            "checkpoint each block in one place only (the inner checkpoint call, or the outer"
            " wrapper such as FSDP's checkpoint_wrapper, not both)",
        ),
        INPUT_GRADS_HOOK: (
            "put an input-grads hook on the input embeddings' output and on inputs_embeds, so that"
            " the checkpointed layers' first input requires grad (use_reentrant kept)",
            "call model.enable_input_require_grads() and pass inputs_embeds that require grad, or"
            " pass use_reentrant=False",
        ),
        LIFT_BOUND_TENSORS: (
            "pass the tensors bound into the checkpointed function (a partial's arguments or"
            " keywords, closure cells, default arguments) to the checkpoint as positional inputs"
            " (use_reentrant kept)",
            "pass those tensors to checkpoint() (or to the checkpointed layer) positionally, or"
            " pass use_reentrant=False",
        ),
        GRAD_INPUT: (
            "hand the call one more input that requires grad, which the function never sees"
            " (use_reentrant kept)",
            "give the call an input that requires grad (a transformers model:"
            " model.enable_input_require_grads(), or inputs_embeds that require grad), or pass"
            " use_reentrant=False",
        ),
        TUPLE_OUTPUTS: (
            "pass the function's result through the checkpoint as a flat tuple and rebuild it after"
            " (use_reentrant kept)",
            "return a tensor or a tuple of tensors from the checkpointed function, or pass"
            " use_reentrant=False",
        ),
    }
)


def refusal(vote: Vote, detail: str = "", because: str = "") -> GcpatchError:
    """Strict mode's answer where fix mode would apply `vote` (not a use_reentrant conflict, which
    `resolve` raises itself): the rule, what it would change (`detail` added to the knob's words),
    and the user's own fix. `because` replaces the vote's reason where another rule's evidence
    shows it (CK1 at the call for R2's withheld hook)."""
    change, fix = CHANGES.get(vote.knob, (f"set {vote.knob}={vote.value}", ""))
    problem = because or PROBLEMS.get(vote.knob) or vote.reason
    return GcpatchError(
        f"{problem}; strict mode changes nothing on its own (fix mode would {change}{detail})",
        rule=vote.rule,
        fix=fix or f"set {vote.knob}={vote.value} yourself, or set GCPATCH_MODE=fix",
    )


def stance_votes(facts: Facts) -> list[Vote]:
    """The core's own votes: the user's explicit ask, and the default when nothing applies: the
    framework's own where it is known (a default that works is a correct choice, and changing it
    is what only a rule may do), else non-reentrant, as PyTorch recommends."""
    if facts.stage not in (Stage.ENABLE, Stage.CONFIG):
        return []
    _warn_string_booleans(facts.asked_kwargs)
    votes = []
    if facts.asked_use_reentrant is not None:
        votes.append(
            Vote(
                USE_REENTRANT,
                facts.asked_use_reentrant,
                USER,
                "USER",
                f"asked for by {facts.asked_from}",
                plugin="core",
                short="as asked",
            )
        )
    votes.append(_default_vote(facts))
    return votes


def _default_vote(facts: Facts) -> Vote:
    if facts.default_use_reentrant is None:
        return Vote(
            USE_REENTRANT,
            False,
            DEFAULT,
            "DEFAULT",
            "no rule applies and the framework's own default is not known: non-reentrant, as"
            " PyTorch recommends (torch.utils.checkpoint docs)",
            plugin="core",
            short="no rule applies, PyTorch's recommendation",
        )
    value, owner = facts.default_use_reentrant, facts.default_from or "the framework"
    return Vote(
        USE_REENTRANT,
        value,
        DEFAULT,
        "DEFAULT",
        f"no rule finds {owner}'s own default, use_reentrant={value}, wrong: kept",
        plugin="core",
        short=f"{owner}'s default",
    )


# Checkpoint arguments torch reads as switches: `if use_reentrant:` makes the string "False" True.
_SWITCH_KWARGS = ("use_reentrant", "preserve_rng_state")


def _warn_string_booleans(asked: object) -> None:
    from gcpatch import settings

    for name in _SWITCH_KWARGS:
        value = asked.get(name) if isinstance(asked, dict) else None
        if isinstance(value, str):
            settings.report_once(
                f"kwarg:{name}={value}",
                f"gcpatch: {name}={value!r} is a string, which torch reads as {bool(value)} (any"
                f" non-empty string is true); gcpatch reads it as {bool(value)} too; pass"
                f" {name}=True or {name}=False, not a string",
            )


# The tie rule: the value PyTorch recommends for the knob, where it recommends one.
TIE_VALUES = {USE_REENTRANT: False}


def resolve(votes: list[Vote], mode: str) -> Decision:
    votes = sorted(votes, key=_canonical)
    decision = Decision(mode=mode, values={}, winners={})
    for knob in _knobs_in_order(votes):
        winner = _resolve_knob([v for v in votes if v.knob == knob], mode, decision)
        if winner is None:
            continue
        decision.winners[knob] = winner
        decision.values[knob] = winner.value
        decision.overruled.extend(v for v in votes if v.knob == knob and v.value != winner.value)
    return decision


def _resolve_knob(votes: list[Vote], mode: str, decision: Decision) -> Vote | None:
    required = [v for v in votes if v.strength == REQUIRED]
    user = next((v for v in votes if v.strength == USER), None)
    chosen = _settle_required(required, mode, decision) if required else None
    if chosen is None:
        top = max(STRENGTH_ORDER[v.strength] for v in votes)
        winner = _tie_break([v for v in votes if STRENGTH_ORDER[v.strength] == top])
        if winner.strength == USER:
            decision.warnings.extend(
                f"{v.rule}: your {v.knob}={winner.value} is kept (it is correct); {v.kept_cost}"
                for v in votes
                if v.kept_cost and v.value != winner.value
            )
        return winner
    if chosen.knob in _STATE_KNOBS and mode == "warn":
        decision.warnings.append(f"{chosen.rule}: {chosen.reason} (warn mode: left as it is)")
        return None
    if chosen.knob in _STATE_KNOBS and mode == "strict":
        raise refusal(chosen)
    if user is None or user.value == chosen.value:
        return chosen
    conflict = (
        f"{chosen.rule} requires {chosen.knob}={chosen.value} ({chosen.reason}); "
        f"the user asked {user.knob}={user.value} ({user.reason})"
    )
    if mode == "strict":
        raise GcpatchError(
            f"{conflict}; strict mode changes nothing on its own (fix mode would change"
            f" {chosen.knob} {user.value} -> {chosen.value})",
            rule=chosen.rule,
            fix=f"pass {chosen.knob}={chosen.value}, or set GCPATCH_MODE=warn to keep yours",
        )
    if mode == "warn":
        decision.warnings.append(f"{conflict}; warn mode keeps the user's value")
        return user
    decision.warnings.append(f"{conflict}; fix mode applies {chosen.rule}")
    return chosen


def _settle_required(required: list[Vote], mode: str, decision: Decision) -> Vote:
    if len({repr(v.value) for v in required}) == 1:
        return required[0]
    worst = max(FAILURE_ORDER.get(v.avoids, 0) for v in required)
    top = [v for v in required if FAILURE_ORDER.get(v.avoids, 0) == worst]
    chosen = _tie_break(top)
    reasons = "; ".join(
        f"{v.rule} wants {v.value} to avoid {v.avoids or 'a failure'} ({v.reason})"
        for v in required
    )
    if len({repr(v.value) for v in top}) == 1:
        verdict = f"{chosen.rule} wins (it avoids the worse failure, {chosen.avoids})"
    else:
        losers = sorted({v.rule for v in top if repr(v.value) != repr(chosen.value)})
        verdict = (
            f"{' and '.join(sorted({v.rule for v in top}))} avoid equally bad failures "
            f"({chosen.avoids or 'unstated'}), so this is a tie, settled by the tie rule: "
            f"{_tie_rule(chosen)}; what {', '.join(losers)} guards against may still happen"
        )
    text = f"required votes disagree on {chosen.knob}: {reasons}; {verdict}"
    if mode == "strict":
        raise GcpatchError(
            text,
            rule="+".join(sorted({v.rule for v in required})),
            fix="change the set-up so that only one of these rules applies",
        )
    decision.conflicts.append(text)
    return chosen


def _tie_break(votes: list[Vote]) -> Vote:
    """Among votes of equal standing: all agree, or the knob's PyTorch-recommended value, or
    the lowest rule id's value. `votes` is in canonical order, so this ignores plugin order."""
    if len({repr(v.value) for v in votes}) == 1:
        return votes[0]
    knob = votes[0].knob
    if knob in TIE_VALUES:
        preferred = [v for v in votes if type(v.value) is bool and v.value is TIE_VALUES[knob]]
        if preferred:
            return preferred[0]
    return votes[0]


def _tie_rule(chosen: Vote) -> str:
    if chosen.knob in TIE_VALUES and chosen.value is TIE_VALUES[chosen.knob]:
        return (
            f"{chosen.knob}={chosen.value}, the value PyTorch recommends (torch.utils.checkpoint"
            " docs)"
        )
    return f"{chosen.knob}={chosen.value}, the value of the lowest rule id ({chosen.rule})"


def _canonical(vote: Vote) -> tuple:
    return (
        -STRENGTH_ORDER.get(vote.strength, -1),
        vote.rule,
        vote.plugin,
        vote.knob,
        repr(vote.value),
        vote.avoids,
        vote.reason,
    )


def _knobs_in_order(votes: list[Vote]) -> list[str]:
    """Known knobs in their declared order, then any other by name."""
    names = {vote.knob for vote in votes}
    return [k for k in KNOBS if k in names] + sorted(names - set(KNOBS))
