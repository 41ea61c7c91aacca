"""Every console line gcpatch renders is whole: a decision's line keeps its subject, every action
and its fix. Where it must fit one row (LIMIT), its reasons give way first (the other parts', then
the first part's); where even its actions do not fit, it is wrapped at words, each row within
LIMIT, never cut ("..."). `gcpatch explain` prints each line whole (`limit=None`). A long message
(a plan, a verification, a crash note) wraps at words and loses nothing. The integration suite
applies the same check to every line its runs print (integration/_run.py `line_problems`)."""

from __future__ import annotations

import itertools
import re

import pytest

from gcpatch import headline

R1_REASON = (
    "frozen upstream of 4 blocks: reentrant needs the input to require grad, or the blocks'"
    " parameters get no gradient (transformers#23170); non-reentrant tracks them"
)
MODELS = [
    "LlamaForCausalLM",
    "PeftModelForCausalLM",
    "Qwen3MoeForConditionalGenerationWithAVeryLongName",
]
REASONS = [
    R1_REASON,
    "short",
    "x" * 150,
    "a model in eval mode skips checkpointing: " + "word " * 40,
]
KNOB_SETS = [
    {"use_reentrant": False},
    {"use_reentrant": False, "input_grads_hook": True, "eval_mode_fix": 4},
    {"use_reentrant": True, "grad_input": True, "tuple_outputs": True, "lift_bound_tensors": True},
]


def _entry(model: str, reason: str, applied: dict, asked, stage: str) -> dict:
    winners = {
        knob: {"knob": knob, "rule": "R1", "strength": "required", "value": v, "reason": reason}
        for knob, v in applied.items()
    }
    entry = {
        "stage": stage,
        "model": model,
        "instance": 2,
        "source": "wrapped by PeftModelForCausalLM",
        "site": "/home/user/" + "deep/" * 20 + "modeling.py:123",
        "asked": {"use_reentrant": asked, "from": "the call"},
        "applied": applied,
        "decision": {"winners": winners, "overruled": [], "warnings": [], "conflicts": []},
        "facts": {"default_use_reentrant": False, "default_from": "transformers 5.24.0"},
    }
    return entry


# What each kind of line must keep whatever its length: the action of each knob that took
# effect, and where a rule met the user's ask or warn mode left one unapplied, the fix.
ACTIONS = {
    "use_reentrant": "use_reentrant",
    "input_grads_hook": "input-grads hook",
    "eval_mode_fix": "eval-mode layers checkpoint anyway",
    "grad_input": "an input that requires grad, reentrant kept",
    "tuple_outputs": "result passed through as a tuple",
    "lift_bound_tensors": "bound tensors passed as inputs",
}
KINDS = {
    "plain": (),
    "overrule": ("R1 overrules your use_reentrant=True -> False", "GCPATCH_MODE=warn keeps it"),
    "warn_keep": (
        "warn mode keeps use_reentrant=True over R1",
        "gradients will be wrong",
        "pass use_reentrant=False",
    ),
    "warn_state": (
        "warn mode leaves R5 unapplied",
        "checkpointing would silently do nothing",
        "call model.train()",
    ),
}


def _with(entry: dict, kind: str, reason: str) -> dict:
    """`entry` as gcpatch/resolve.py leaves a decision where a required rule met the user's ask
    (fix or warn mode), or where warn mode left R5 unapplied."""
    decision = entry["decision"]
    ask = {
        "knob": "use_reentrant",
        "value": True,
        "strength": "user",
        "rule": "USER",
        "reason": "asked for by M.gradient_checkpointing_enable(...)",
    }
    rule = {
        "knob": "use_reentrant",
        "value": False,
        "strength": "required",
        "rule": "R1",
        "reason": reason,
        "avoids": "wrong_gradients",
    }
    if kind == "overrule":
        entry["asked"]["use_reentrant"] = True
        entry["applied"]["use_reentrant"] = False
        decision["winners"]["use_reentrant"] = rule
        decision["overruled"] = [ask]
        decision["warnings"] = [
            f"R1 requires use_reentrant=False ({reason}); the user asked"
            " use_reentrant=True (asked); fix mode applies R1"
        ]
    elif kind == "warn_keep":
        entry["asked"]["use_reentrant"] = True
        entry["applied"]["use_reentrant"] = True
        decision["winners"]["use_reentrant"] = ask
        decision["overruled"] = [rule]
        decision["warnings"] = [
            f"R1 requires use_reentrant=False ({reason}); the user asked"
            " use_reentrant=True (asked); warn mode keeps the user's value"
        ]
    elif kind == "warn_state":
        decision["warnings"] = [
            "R5: 4 of 4 checkpointed layers are in eval mode at the first training forward:"
            " checkpointing would silently do nothing (warn mode: left as it is)"
        ]
    return entry


ENTRIES = [
    (_with(_entry(model, reason, dict(applied), asked, stage), kind, reason), kind)
    for model, reason, applied, asked, stage, kind in itertools.product(
        MODELS, REASONS, KNOB_SETS, [None, True, False], ["enable", "call", "first_forward"], KINDS
    )
]


def _words(text: str) -> set[str]:
    return {w.strip("(),;:") for w in text.split()} - {""}


def test_every_rendered_decision_line_keeps_its_actions_and_is_never_cut():
    shortened = wrapped = kept = 0
    for entry, kind in ENTRIES:
        short, whole = headline.line(entry), headline.line(entry, limit=None)
        rows, said = short.split("\n"), headline.unwrap(short)
        assert all(len(row) <= headline.LIMIT for row in rows), short
        assert "..." not in short and "..." not in whole and "\n" not in whole, short
        for knob, value in entry["applied"].items():
            assert not value or ACTIONS[knob] in said, (knob, short)
        for words in KINDS[kind]:
            assert words in said, (words, short)
        assert set(re.findall(r"\b(?:R|CK)\d\b", whole)) <= _words(said), short  # every rule
        # nothing added, no word cut: a word longer than a row is only broken across rows
        assert all(any(w in word for word in _words(whole)) for w in _words(said)), short
        if len(whole) <= headline.LIMIT:
            assert short == whole  # nothing to give up
        elif len(rows) == 1:
            shortened += 1
        else:  # its actions alone do not fit one row: wrapped into the fewest rows
            wrapped += 1
            assert len(rows) <= headline.wrap(whole).count("\n") + 1, short
            first = whole[len(_head(whole)) :].split("; ")[0].replace(" ", "")
            kept += said[len(_head(said)) :].replace(" ", "").startswith(first)
    assert shortened > 10 and wrapped > 50  # the check has something to check either way
    assert kept > 50  # mostly, the first part's reason fits the rows the actions take anyway


def _head(text: str) -> str:
    return re.match(r"gcpatch: (checkpoint call at \S+|.+?(\(\S+\))?): ", text).group(0)


@pytest.mark.parametrize("width", [1, 7, 60, 119, 120, 121, 400])
def test_wrap_keeps_every_word_within_the_limit(width):
    text = " ".join(["gcpatch:"] + ["w" * width] * 3 + ["end"])
    wrapped = headline.wrap(text)
    lines = wrapped.split("\n")
    assert all(len(line) <= headline.LIMIT for line in lines), [len(x) for x in lines]
    assert all(line.startswith(headline.INDENT) for line in lines[1:])
    assert headline.unwrap(wrapped).replace(" ", "") == text.replace(" ", "")


def test_a_reason_is_given_up_whole_never_cut():
    """A reason too long for the row is dropped to its rule id; `explain` shows it whole."""
    entry = _entry("LlamaForCausalLM", "x" * 150, {"use_reentrant": False}, True, "enable")
    short, whole = headline.line(entry), headline.line(entry, limit=None)
    head = "gcpatch: LlamaForCausalLM #2 (PeftModelForCausalLM): use_reentrant True -> False (R1"
    assert (short, whole) == (head + ")", head + ": " + "x" * 150 + ")")


def test_a_warning_about_a_config_names_the_model_by_its_last_path_part():
    """A config names the model by its path (Axolotl's `base_model`): the line names its last part,
    so the rule, the overruled ask and the way to keep it stay on the line, one line a decision."""
    entry = _entry(
        "/tmp/" + "deep/" * 20 + "tiny", R1_REASON, {"use_reentrant": False}, True, "config"
    )
    entry["instance"] = None
    user = {
        "knob": "use_reentrant",
        "rule": "USER",
        "strength": "user",
        "value": True,
        "reason": "",
    }
    entry["decision"]["overruled"] = [user]
    entry["decision"]["warnings"] = ["R1 overrules use_reentrant=True; the user asked for it"]
    assert headline.warnings(entry) == []  # said by the line
    said = "gcpatch: tiny (PeftModelForCausalLM): R1 overrules your use_reentrant=True -> False"
    whole = said + " (frozen upstream of 4 blocks; GCPATCH_MODE=warn keeps it)"
    assert headline.line(entry, limit=None) == whole
    assert headline.unwrap(headline.line(entry)) == whole  # two rows keep its reason
