"""Every console line gcpatch renders is whole: at most LIMIT characters, and where a decision's
line is cut, it is cut at a word and says where the rest is (`gcpatch explain -v`); a long message
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


ENTRIES = [
    _entry(*combo)
    for combo in itertools.product(
        MODELS, REASONS, KNOB_SETS, [None, True, False], ["enable", "call", "first_forward"]
    )
]


def _full(entry: dict, monkeypatch) -> str:
    with monkeypatch.context() as m:
        m.setattr(headline, "LIMIT", 10**6)
        return headline.line(entry)


def _words(text: str) -> set[str]:
    return {w.strip("(),;:") for w in text.split()} - {
        "",
        "...",
        "gcpatch",
        "explain",
        "-v",
        "more",
    }


def test_every_rendered_decision_line_is_whole(monkeypatch):
    cut = 0
    for entry in ENTRIES:
        short, full = headline.line(entry), _full(entry, monkeypatch)
        assert len(short) <= headline.LIMIT, short
        assert not re.search(r"\w\.\.\.", short), short  # no word cut short ("needs t...")
        if short == full:
            continue
        cut += 1
        # only whole words of the full line (a word cut inside would be a new one), its rule ids
        # all kept for what is shown, and where it is cut, where the rest is
        shown = {w for w in _words(short) if not re.fullmatch(r"\+\d+", w)}
        assert shown <= _words(full), (shown - _words(full), short)
        first = short.split("; ")[0]
        assert re.search(r"\((R|CK|X)\d", first), short  # the first change names its rule
        assert short.endswith((headline.MORE, " more")) or len(short) < len(full), short
    assert cut > 50  # the long reasons above do need cutting: the check has something to check


@pytest.mark.parametrize("width", [1, 7, 60, 119, 120, 121, 400])
def test_wrap_keeps_every_word_within_the_limit(width):
    text = " ".join(["gcpatch:"] + ["w" * width] * 3 + ["end"])
    wrapped = headline.wrap(text)
    lines = wrapped.split("\n")
    assert all(len(line) <= headline.LIMIT for line in lines), [len(x) for x in lines]
    assert all(line.startswith(headline.INDENT) for line in lines[1:])
    assert headline.unwrap(wrapped).replace(" ", "") == text.replace(" ", "")


def test_a_short_reason_is_cut_at_a_word():
    vote = {"rule": "R1", "reason": R1_REASON.replace(": ", " ")}
    short = headline._short(vote)
    assert (
        len(short) <= 60
        and short.endswith(" ...")
        and R1_REASON.replace(": ", " ").startswith(short.removesuffix(" ..."))
    ), short


def test_a_warning_about_a_config_names_the_model_by_its_last_path_part():
    """A config names the model by its path (Axolotl's `base_model`): the warning names its last
    part, as the decision's line does, so the rule and the overruled ask stay on the line."""
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
    (warning,) = headline.warnings(entry)
    assert warning == (
        "gcpatch: tiny: R1 overrules your use_reentrant=True (GCPATCH_MODE=warn keeps it)"
    ), warning
    assert headline.line(entry).startswith("gcpatch: tiny (PeftModelForCausalLM): ")
