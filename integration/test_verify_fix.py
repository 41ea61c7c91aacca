"""Verify closes the loop in fix mode: when the first training forward's measurement finds wrong
gradients, gcpatch switches the model to non-reentrant before the user's step runs, verifies again,
and the step is bit-identical to a run configured correctly from the start (gradients, optimizer
state, RNG). The fault is one no rule sees (integration/scripts/verify_fix.py: layers that take
their hidden states by keyword, with the torch plugin and so its call-site rules blocked): reentrant
asked by the user, or voted required by a third-party plugin (integration/third_party)."""

from __future__ import annotations

from pathlib import Path

from _run import Spec

SCRIPT = "verify_fix.py"
THIRD_PARTY = str(Path(__file__).resolve().parent / "third_party")
BLOCKED = {"GCPATCH_VERIFY": "1", "GCPATCH_DISABLE_PLUGINS": "torch"}
PLUGIN = {**BLOCKED, "PYTHONPATH": THIRD_PARTY}
RUNS = [
    Spec(SCRIPT, ("--reentrant", "true"), env=tuple(sorted(BLOCKED.items()))),
    Spec(SCRIPT, ("--reentrant", "true", "--offloader"), env=(("GCPATCH_VERIFY", "1"),)),
    Spec(SCRIPT, ("--reentrant", "false"), env=tuple(sorted(PLUGIN.items()))),
    Spec(
        SCRIPT,
        ("--reentrant", "true"),
        env=tuple(sorted({**BLOCKED, "GCPATCH_MODE": "warn"}.items())),
    ),
]
DIGESTS = ("grads", "loss", "optimizer_state", "params_after", "rng_after")


def _verify_records(run):
    return [r for r in run.records() if r.get("stage") == "verify"]


def _assert_corrected(run, correct, asked):
    assert run.result["missing"] == 0, run.describe()
    assert {k: run.result[k] for k in DIGESTS} == {
        k: correct.result[k] for k in DIGESTS
    }  # bit for bit
    first, second = _verify_records(run)
    assert not first["verify"]["gradients_match"] and len(first["verify"]["missing"]) == 13
    assert second["corrected"] == "use_reentrant True -> False"
    assert not second["verify_before"]["gradients_match"] and second["verify"]["gradients_match"]
    assert (
        "changed before the first step: use_reentrant True -> False (VERIFY: 13 of 15 gradients differed"
        in second["line"]
        and "verified again: gradients match (15 tensors" in second["line"]
    ), second["line"]
    last = [r for r in run.records() if r.get("stage") == "enable"][-1]
    assert (
        last["source"] == "verify"
        and last["decision"]["winners"]["use_reentrant"]["rule"] == "VERIFY"
    )
    assert last["applied"]["use_reentrant"] is False and last["asked"]["use_reentrant"] is asked
    lines = [line for line in run.messages() if "changed before the first step" in line]
    assert len(lines) == 1, run.stderr


def test_verify_corrects_a_wrong_reentrant_ask_before_the_first_step(script_runs):
    plain = script_runs.get(SCRIPT, "--reentrant", "true", gcpatch=False)
    assert (
        plain.result["missing"] == 13 and plain.result["trainable"] == 15
    )  # what the plain run trains on
    correct = script_runs.get(SCRIPT, "--reentrant", "false", gcpatch=False)
    assert correct.result["missing"] == 0
    run = script_runs.get(SCRIPT, "--reentrant", "true", gcpatch=True, env=BLOCKED)
    _assert_corrected(run, correct, asked=True)


def test_verify_overrides_a_third_party_rule_voting_reentrant_where_it_is_wrong(script_runs):
    correct = script_runs.get(SCRIPT, "--reentrant", "false", gcpatch=False)
    run = script_runs.get(SCRIPT, "--reentrant", "false", gcpatch=True, env=PLUGIN)
    first = [r for r in run.records() if r.get("stage") == "enable"][0]
    assert (
        first["decision"]["winners"]["use_reentrant"]["rule"] == "Z1"
    )  # the plugin's vote won at enable time
    _assert_corrected(run, correct, asked=False)
    assert any(
        "Z1" in text
        for r in run.records()
        if r.get("stage") == "enable" and r["source"] == "verify"
        for text in r["decision"]["conflicts"]
    )  # the record keeps the rule the evidence overrode


def test_warn_mode_reports_and_changes_nothing(script_runs):
    plain = script_runs.get(SCRIPT, "--reentrant", "true", gcpatch=False)
    run = script_runs.get(
        SCRIPT, "--reentrant", "true", gcpatch=True, env={**BLOCKED, "GCPATCH_MODE": "warn"}
    )
    assert run.result["grads"] == plain.result["grads"] and run.result["missing"] == 13
    [verified] = _verify_records(run)
    assert not verified["verify"]["gradients_match"] and "corrected" not in verified


def test_the_last_resort_is_checkpointing_off_for_the_blocks_non_reentrant_cannot_fix(script_runs):
    """A tool's own reentrant-only checkpoint function (an offloader) ignores use_reentrant: the
    switch to non-reentrant changes nothing, verify says so, and fix mode switches checkpointing off
    for the offending blocks; the step equals one that never checkpointed, bit for bit."""
    plain = script_runs.get(SCRIPT, "--reentrant", "true", "--offloader", gcpatch=False)
    assert plain.result["missing"] == 13
    never = script_runs.get(SCRIPT, "--reentrant", "true", "--no-checkpointing", gcpatch=False)
    run = script_runs.get(
        SCRIPT, "--reentrant", "true", "--offloader", gcpatch=True, env={"GCPATCH_VERIFY": "1"}
    )
    assert run.result["missing"] == 0, run.describe()
    assert {k: run.result[k] for k in DIGESTS} == {k: never.result[k] for k in DIGESTS}
    first, switched, off = _verify_records(run)
    assert (
        switched["corrected"] == "use_reentrant True -> False"
        and not switched["verify"]["gradients_match"]
    )
    assert off["corrected"].startswith("checkpointing off for 3 of 3 checkpointed blocks")
    assert off["verify"]["gradients_match"] and off["verify"]["blocks"] == {}
    assert len([line for line in run.messages() if "changed before the first step" in line]) == 2
