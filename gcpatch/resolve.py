"""Resolving votes into one decision (RULES.md §3).

Per knob the strongest vote wins: required > user > recommended > default. A required vote
against the user's explicit choice wins in fix mode (with a warning), loses in warn mode
(with a warning) and raises in strict mode. Required votes that disagree are settled by the
failure each avoids, and both reasons are recorded.
"""
from __future__ import annotations

from gcpatch.errors import GcpatchError
from gcpatch.schema import (
    DEFAULT,
    EVAL_MODE_FIX,
    FAILURE_ORDER,
    RUN_INLINE,
    REQUIRED,
    STRENGTH_ORDER,
    USE_REENTRANT,
    USER,
    Decision,
    Facts,
    Vote,
)

# Knobs about how the user's own code runs rather than a checkpoint argument: warn mode only
# warns about them (R5, CK2).
_STATE_KNOBS = (EVAL_MODE_FIX, RUN_INLINE)


def stance_votes(facts: Facts) -> list[Vote]:
    """The core's own votes: the user's explicit ask, and the default when nothing applies."""
    if facts.stage not in ("enable", "config"):
        return []
    votes = []
    if facts.asked_use_reentrant is not None:
        votes.append(Vote(USE_REENTRANT, facts.asked_use_reentrant, USER, "USER",
                          f"asked for by {facts.asked_from}", plugin="core"))
    votes.append(Vote(USE_REENTRANT, False, DEFAULT, "DEFAULT",
                      "no rule applies: non-reentrant, as PyTorch recommends (torch.utils.checkpoint docs)",
                      plugin="core"))
    return votes


def resolve(votes: list[Vote], mode: str) -> Decision:
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
        return max(votes, key=lambda v: STRENGTH_ORDER[v.strength])  # max keeps the first of equals
    if chosen.knob in _STATE_KNOBS and mode == "warn":
        decision.warnings.append(f"{chosen.rule}: {chosen.reason} (warn mode: left as it is)")
        return None
    if user is None or user.value == chosen.value:
        return chosen
    conflict = (f"{chosen.rule} requires {chosen.knob}={chosen.value} ({chosen.reason}); "
                f"the user asked {user.knob}={user.value} ({user.reason})")
    if mode == "strict":
        raise GcpatchError(conflict, rule=chosen.rule,
                           fix=f"pass {chosen.knob}={chosen.value}, or set GCPATCH_MODE=warn to keep yours")
    if mode == "warn":
        decision.warnings.append(f"{conflict}; warn mode keeps the user's value")
        return user
    decision.warnings.append(f"{conflict}; fix mode applies {chosen.rule}")
    return chosen


def _settle_required(required: list[Vote], mode: str, decision: Decision) -> Vote:
    if len({repr(v.value) for v in required}) == 1:
        return required[0]
    chosen = max(required, key=lambda v: FAILURE_ORDER.get(v.avoids, 0))
    reasons = "; ".join(f"{v.rule} wants {v.value} to avoid {v.avoids or 'a failure'} ({v.reason})" for v in required)
    text = f"required votes disagree on {chosen.knob}: {reasons}; {chosen.rule} wins (the worse failure)"
    if mode == "strict":
        raise GcpatchError(text, rule="+".join(v.rule for v in required),
                           fix="change the set-up so that only one of these rules applies")
    decision.conflicts.append(text)
    return chosen


def _knobs_in_order(votes: list[Vote]) -> list[str]:
    knobs: list[str] = []
    for vote in votes:
        if vote.knob not in knobs:
            knobs.append(vote.knob)
    return knobs
