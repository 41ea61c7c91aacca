"""The resolver's stance, on votes built by hand: strengths, modes, conflicts."""

from __future__ import annotations

import pytest

from gcpatch.errors import GcpatchError
from gcpatch.resolve import resolve
from gcpatch.schema import (
    CRASH,
    DEFAULT,
    EVAL_MODE_FIX,
    RECOMMENDED,
    REQUIRED,
    USE_REENTRANT,
    USER,
    WRONG_GRADIENTS,
    Vote,
)

DEFAULT_FALSE = Vote(USE_REENTRANT, False, DEFAULT, "DEFAULT", "nothing applies")
USER_TRUE = Vote(USE_REENTRANT, True, USER, "USER", "asked")
R1 = Vote(USE_REENTRANT, False, REQUIRED, "R1", "partially frozen", avoids=WRONG_GRADIENTS)
R3 = Vote(USE_REENTRANT, True, REQUIRED, "R3", "zero-3", avoids=CRASH)
A2 = Vote(USE_REENTRANT, True, RECOMMENDED, "A2", "axolotl prefers reentrant")


def test_default_applies_when_nothing_else_votes():
    assert resolve([DEFAULT_FALSE], "fix").values == {USE_REENTRANT: False}


def test_user_beats_recommended_beats_default():
    assert resolve([DEFAULT_FALSE, A2], "fix").winners[USE_REENTRANT].rule == "A2"
    user_false = Vote(USE_REENTRANT, False, USER, "USER", "asked")
    assert resolve([DEFAULT_FALSE, A2, user_false], "fix").winners[USE_REENTRANT].rule == "USER"


def test_a_recommendation_overruled_by_the_user_is_told_only_when_it_names_a_cost():
    user_false = Vote(USE_REENTRANT, False, USER, "USER", "asked")
    quiet = resolve([DEFAULT_FALSE, A2, user_false], "fix")
    assert quiet.values[USE_REENTRANT] is False and quiet.warnings == []
    costly = Vote(
        USE_REENTRANT, False, RECOMMENDED, "F2", "fsdp", kept_cost="an extra all-gather per unit"
    )
    told = resolve([DEFAULT_FALSE, costly, USER_TRUE], "fix")
    assert told.values[USE_REENTRANT] is True and told.winners[USE_REENTRANT].rule == "USER"
    assert told.warnings == [
        "F2: your use_reentrant=True is kept (it is correct); an extra all-gather per unit"
    ]
    assert (
        resolve([DEFAULT_FALSE, costly], "fix").warnings == []
    )  # no ask: the recommendation applies


def test_fix_mode_applies_required_over_user_and_warns():
    decision = resolve([USER_TRUE, R1, DEFAULT_FALSE], "fix")
    assert decision.values[USE_REENTRANT] is False and decision.rules == ["R1"]
    assert "R1" in decision.warnings[0] and "fix mode applies R1" in decision.warnings[0]
    assert USER_TRUE in decision.overruled


def test_warn_mode_keeps_the_users_value_and_warns():
    decision = resolve([USER_TRUE, R1, DEFAULT_FALSE], "warn")
    assert decision.values[USE_REENTRANT] is True
    assert "warn mode keeps the user's value" in decision.warnings[0]


def test_strict_mode_raises_naming_the_rule_and_the_fix():
    with pytest.raises(GcpatchError) as err:
        resolve([USER_TRUE, R1, DEFAULT_FALSE], "strict")
    assert err.value.rule == "R1"
    assert "use_reentrant=False" in str(err.value) and "Fix:" in str(err.value)


def test_required_agreeing_with_user_is_no_conflict():
    decision = resolve([Vote(USE_REENTRANT, False, USER, "USER", "asked"), R1], "strict")
    assert decision.values[USE_REENTRANT] is False and decision.warnings == []


def test_required_conflict_goes_to_the_worse_failure_with_both_reasons():
    decision = resolve([R3, R1], "fix")
    assert decision.values[USE_REENTRANT] is False  # wrong gradients outrank a crash
    assert "R1" in decision.conflicts[0] and "R3" in decision.conflicts[0]
    with pytest.raises(GcpatchError) as err:
        resolve([R3, R1], "strict")
    assert err.value.rule == "R1+R3"  # sorted: never the order plugins voted in


def test_warn_mode_only_warns_about_the_eval_mode_fix():
    r5 = Vote(EVAL_MODE_FIX, True, REQUIRED, "R5", "eval mode")
    assert resolve([r5], "fix").values == {EVAL_MODE_FIX: True}
    decision = resolve([r5], "warn")
    assert decision.values == {} and "R5" in decision.warnings[0]
