"""The words of a decision's line (gcpatch/headline.py): one line a decision, which speaks of the
user's choice only where the user made one (a checkpoint call that named no use_reentrant runs
with torch's default, and its line says what changed, not whom it overruled); where a rule and the
user's ask met, or warn mode left a rule unapplied, that line says so with the consequence and the
fix, at WARNING; no line points at a record (`gcpatch explain -v`) that may not exist. The records
below have the fields and texts gcpatch/resolve.py and gcpatch/record.py write (a CK1 call, a
model left in eval mode, required rules that disagree under DDP)."""

from __future__ import annotations

import logging

import pytest

from gcpatch import headline


def _call(reason: str, mode: str = "fix") -> dict:
    """A reentrant call CK1 makes non-reentrant, as record.call_site writes it."""
    asked = None if reason.startswith("torch's default") else True
    ask = {"knob": "use_reentrant", "value": True, "strength": "user", "rule": "USER"}
    rule = {
        "knob": "use_reentrant",
        "value": False,
        "strength": "required",
        "rule": "CK1",
        "reason": "no positional tensor input requires grad and trainable parameters are inside",
        "avoids": "wrong_gradients",
        "short": "no input requires grad: parameters inside would get none",
    }
    won, lost = (
        (rule, {**ask, "reason": reason}) if mode == "fix" else ({**ask, "reason": reason}, rule)
    )
    ending = "fix mode applies CK1" if mode == "fix" else "warn mode keeps the user's value"
    return {
        "rank": 0,
        "stage": "call",
        "site": "/x/model.py:12",
        "asked": {"use_reentrant": asked, "from": "the call" if asked else "torch's default"},
        "applied": {"use_reentrant": False} if mode == "fix" else {},
        "why": {},
        "decision": {
            "mode": mode,
            "warnings": [
                f"CK1 requires use_reentrant=False ({rule['reason']}); the user asked"
                f" use_reentrant=True ({reason}); {ending}"
            ],
            "winners": {"use_reentrant": won},
            "overruled": [lost],
            "conflicts": [],
        },
    }


def test_a_rule_over_torchs_default_says_what_changed_and_warns_of_no_one():
    entry = _call("torch's default, use_reentrant not passed")
    said = "gcpatch: checkpoint call at model.py:12: use_reentrant unset -> False (CK1"
    # one row: the reason shortened to its first clause, the action whole
    assert headline.line(entry) == said + ": no input requires grad)"
    assert headline.line(entry, limit=None) == (
        said + ": no input requires grad: parameters inside would get none)"
    )
    assert headline.warnings(entry) == [] and headline.level(entry) == logging.INFO


def test_a_rule_over_the_users_ask_is_one_line_that_says_how_to_keep_it():
    """Before, two lines for one decision: the change, then `CK1 overrules your use_reentrant=True
    (GCPATCH_MODE=warn keeps it)`."""
    entry = _call("asked at the call")
    said = "gcpatch: checkpoint call at model.py:12: CK1 overrules your use_reentrant=True -> False"
    whole = (
        said
        + " (no input requires grad: parameters inside would get none; GCPATCH_MODE=warn keeps it)"
    )
    assert headline.line(entry, limit=None) == whole
    # one row cannot hold it with its reason: two rows do, the reason kept, nothing cut
    rows = headline.line(entry).split("\n")
    assert len(rows) == 2 and headline.unwrap("\n".join(rows)) == whole, rows
    assert headline.warnings(entry) == [] and headline.level(entry) == logging.WARNING


@pytest.mark.parametrize(
    "reason", ["asked at the call", "torch's default, use_reentrant not passed"]
)
def test_warn_mode_keeping_a_value_over_a_rule_says_what_follows_and_the_fix(reason):
    entry = _call(reason, mode="warn")
    line = headline.unwrap(headline.line(entry))
    assert line == (
        "gcpatch: checkpoint call at model.py:12: warn mode keeps use_reentrant=True over CK1 (no"
        " input requires grad: parameters inside would get none): gradients will be wrong; pass"
        " use_reentrant=False"
    ), line
    assert all(len(row) <= headline.LIMIT for row in headline.line(entry).split("\n"))
    assert headline.warnings(entry) == [] and headline.level(entry) == logging.WARNING


def _eval_mode_in_warn_mode() -> dict:
    """A first training forward in eval mode, warn mode (resolve.py leaves R5 unapplied)."""
    return {
        "rank": 0,
        "stage": "first_forward",
        "model": "GPT2LMHeadModel",
        "instance": 1,
        "api": "gradient_checkpointing_enable",
        "source": "call",
        "asked": {"use_reentrant": None, "from": "nothing"},
        "applied": {"use_cache_off": "use_cache True -> False"},
        "why": {"use_cache_off": "R6: no KV cache under checkpointing"},
        "decision": {
            "mode": "warn",
            "winners": {"use_cache_off": {"knob": "use_cache_off", "rule": "R6", "value": True}},
            "overruled": [],
            "conflicts": [],
            "warnings": [
                "R5: 4 of 4 checkpointed layers are in eval mode at the first training forward:"
                " checkpointing would silently do nothing (warn mode: left as it is)"
            ],
        },
    }


def test_what_warn_mode_leaves_unapplied_is_said_whole_with_its_fix():
    """Before: `left as asked`, then `warning: R5: 4 of 4 checkpointed layers are in eval mode at
    the ... (gcpatch explain -v)`: the consequence and the fix cut, a pointer to a record that was
    not being written."""
    entry = _eval_mode_in_warn_mode()
    line = headline.unwrap(headline.line(entry))
    assert line == (
        "gcpatch: GPT2LMHeadModel: warn mode leaves R5 unapplied: 4 of 4 checkpointed layers are in"
        " eval mode at the first training forward: checkpointing would silently do nothing; call"
        " model.train() before training, or GCPATCH_MODE=fix applies R5"
    ), line
    assert headline.line(entry, limit=None) == line
    assert headline.warnings(entry) == [] and headline.level(entry) == logging.WARNING


def test_required_rules_that_disagree_point_at_the_rule_table_not_a_record():
    entry = _call("asked at the call")
    entry["decision"]["warnings"] = []
    entry["decision"]["overruled"] = [
        {"knob": "use_reentrant", "value": True, "strength": "required", "rule": "R1"}
    ]
    entry["decision"]["conflicts"] = [
        "required votes disagree on use_reentrant: R1 wants True to avoid wrong_gradients (x); CK1"
        " wants False to avoid wrong_gradients (y); R1 and CK1 avoid equally bad failures"
    ]
    (warning,) = headline.warnings(entry)
    assert headline.unwrap(warning) == (
        "gcpatch: model.py:12: required rules disagree on use_reentrant; CK1 wins over R1"
        " (`gcpatch rules` says what each guards against)"
    ), warning


def test_a_kept_asks_cost_is_said_whole():
    """A recommendation's cost told where the user's explicit ask overrules it (FSDP's F2): long
    texts wrap, nothing of them is cut."""
    entry = _eval_mode_in_warn_mode()
    cost = (
        "F2: your use_reentrant=True is kept (it is correct); reentrant recompute all-gathers again"
        " in backward under FSDP, once per unit and step: pass use_reentrant=False to save it"
    )
    entry["decision"]["warnings"] = [cost]
    (warning,) = headline.warnings(entry)
    assert headline.unwrap(warning) == f"gcpatch: GPT2LMHeadModel: warning: {cost}"
    assert all(len(row) <= headline.LIMIT for row in warning.split("\n")) and "..." not in warning
