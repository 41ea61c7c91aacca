"""Scenario b (R1, X3): the partially frozen Llama trained by transformers.Trainer with
TrainingArguments(gradient_checkpointing=True) and no checkpointing kwargs. The first step's
gradients are compared with the same Trainer set-up without checkpointing.

Plain 4.57's Trainer asks for reentrant checkpointing (its default) and loses layer 1's
gradients; plain 5.x defaults to non-reentrant and is correct. With gcpatch R1 decides.
"""

from __future__ import annotations

from _asserts import assert_explained, assert_installed_gcpatch_ran, assert_plain, enable_records
from _run import V5, Spec, reentrant

SCRIPT = "frozen_llama_trainer.py"
RUNS = [Spec(SCRIPT)]


def test_trainer_checkpointing_gives_frozen_model_exact_gradients(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["trainable"] == 11
    assert r["wrong"] == 0, r["wrong_names"]
    assert r["ref_grad_none"] == 0
    assert r["applied_use_reentrant"] is False


def test_plain_trainer_checkpointing_outcome_per_version(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=False)
    assert_plain(run)
    r = run.result
    assert r["trainable"] == 11
    if V5:  # 5.x's Trainer defaults to use_reentrant=False: correct without gcpatch
        assert r["applied_use_reentrant"] is False
        assert r["wrong"] == 0, r["wrong_names"]
    else:  # 4.57's gradient_checkpointing_enable(None) means use_reentrant=True
        assert reentrant(r["applied_use_reentrant"]) is True
        assert r["wrong"] == 9 and r["grad_none"] == 9, r["wrong_names"]


def test_trainer_enable_is_recorded_as_r1_with_trainer_source(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=True)
    records = enable_records(run)
    assert [r["source"] for r in records] == ["trainer"], records
    rec = records[0]
    assert rec["asked"]["use_reentrant"] is None  # TrainingArguments named no kwargs
    assert "train" in rec["asked"]["from"].lower(), rec[
        "asked"
    ]  # attributed to the Trainer / TrainingArguments
    assert rec["applied"]["use_reentrant"] is False
    assert "R1" in rec["rules"] and rec["why"]["use_reentrant"].startswith("R1:")
    assert rec["decision"]["warnings"] == []  # nothing was asked, so nothing was overruled
    lines = run.gcpatch_lines()
    # 5.x defaults to non-reentrant, and R1 agrees; 4.x defaults to reentrant, which R1 changes
    said = (
        " (trainer): use_reentrant=False, transformers 5."
        if V5
        else " (trainer): use_reentrant True (default) -> False (R1: "
    )
    assert len(lines) == 1 and said in lines[0], run.stderr
    assert not V5 or "'s default (R1 agrees)" in lines[0], lines
    assert_explained(run, "R1", "use_reentrant=False", "(trainer, enable)")
