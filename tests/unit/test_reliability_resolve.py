"""The resolver is total, deterministic and independent of the order votes arrive in (plugin
order), over random votes and modes (hypothesis); required votes avoiding equally bad failures
are settled by the stated tie rule, and the message says it was a tie."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcpatch.errors import GcpatchError
from gcpatch.resolve import resolve
from gcpatch.schema import (
    CRASH,
    DEFAULT,
    FAILURE_ORDER,
    INPUT_GRADS_HOOK,
    KNOBS,
    NO_MEMORY_SAVED,
    RECOMMENDED,
    REQUIRED,
    USE_REENTRANT,
    USER,
    Vote,
)

MODES = ("fix", "warn", "strict")
votes_st = st.builds(
    Vote,
    knob=st.sampled_from(KNOBS),
    value=st.booleans(),
    strength=st.sampled_from((REQUIRED, RECOMMENDED, DEFAULT)),
    rule=st.sampled_from(("R1", "R2", "R3", "R4", "A2", "T1", "X9")),
    reason=st.sampled_from(("a", "b")),
    plugin=st.sampled_from(("transformers", "deepspeed", "third")),
    avoids=st.sampled_from(tuple(FAILURE_ORDER)),
)
user_st = st.builds(
    Vote,
    knob=st.just(USE_REENTRANT),
    value=st.booleans(),
    strength=st.just(USER),
    rule=st.just("USER"),
    reason=st.just("asked"),
    plugin=st.just("core"),
)
vote_lists = st.tuples(st.lists(votes_st, max_size=7), st.lists(user_st, max_size=1)).map(
    lambda t: t[0] + t[1]
)


def _outcome(votes, mode):
    try:
        return resolve(list(votes), mode).to_dict()
    except GcpatchError as exc:
        return ("GcpatchError", str(exc), exc.rule)


@settings(max_examples=300, deadline=None)
@given(vote_lists, st.sampled_from(MODES), st.randoms(use_true_random=False))
def test_total_deterministic_and_order_independent(votes, mode, rnd):
    first = _outcome(votes, mode)  # total: a Decision or a GcpatchError, nothing else escapes
    assert _outcome(votes, mode) == first
    shuffled = list(votes)
    rnd.shuffle(shuffled)
    assert _outcome(shuffled, mode) == first
    if not isinstance(first, tuple):
        knobs = {v.knob for v in votes}
        for knob in first["values"]:
            assert knob in knobs
        if mode == "fix":  # a required vote always wins its knob in fix mode
            for knob in knobs:
                if any(v.knob == knob and v.strength == REQUIRED for v in votes):
                    assert first["winners"][knob]["strength"] == REQUIRED


@settings(max_examples=200, deadline=None)
@given(st.lists(votes_st.filter(lambda v: v.strength == REQUIRED), min_size=2, max_size=5))
def test_every_permutation_of_required_votes_decides_the_same(votes):
    outcomes = {
        repr(_outcome(p, "fix")) for p in itertools.islice(itertools.permutations(votes), 24)
    }
    assert len(outcomes) == 1


R3 = Vote(
    USE_REENTRANT,
    True,
    REQUIRED,
    "R3",
    "zero-3 partitioned params",
    plugin="deepspeed",
    avoids=CRASH,
)
R4 = Vote(USE_REENTRANT, False, REQUIRED, "R4", "ddp unused params", plugin="ddp", avoids=CRASH)


@pytest.mark.parametrize("order", [(R3, R4), (R4, R3)])
def test_equally_bad_failures_tie_goes_to_pytorchs_value_with_an_honest_message(order):
    decision = resolve(list(order), "fix")
    assert decision.values[USE_REENTRANT] is False  # the value PyTorch recommends
    assert decision.winners[USE_REENTRANT].rule == "R4"
    text = decision.conflicts[0]
    assert "R3 and R4 avoid equally bad failures (crash)" in text and "tie rule" in text
    assert "the worse failure" not in text and "what R3 guards against may still happen" in text


def test_a_tie_on_a_knob_without_a_recommended_value_goes_to_the_lowest_rule_id():
    a = Vote(INPUT_GRADS_HOOK, False, REQUIRED, "Z9", "z", avoids=NO_MEMORY_SAVED)
    b = Vote(INPUT_GRADS_HOOK, True, REQUIRED, "B2", "b", avoids=NO_MEMORY_SAVED)
    for order in ([a, b], [b, a]):
        decision = resolve(order, "fix")
        assert (
            decision.values[INPUT_GRADS_HOOK] is True
            and "lowest rule id (B2)" in decision.conflicts[0]
        )


def test_recommendations_that_disagree_do_not_depend_on_plugin_order():
    a2 = Vote(USE_REENTRANT, True, RECOMMENDED, "A2", "axolotl")
    t1 = Vote(USE_REENTRANT, False, RECOMMENDED, "T1", "trl")
    assert (
        resolve([a2, t1], "fix").values == resolve([t1, a2], "fix").values == {USE_REENTRANT: False}
    )
