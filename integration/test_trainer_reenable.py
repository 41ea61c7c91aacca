"""Scenario d (X3, transformers#26221): the user enables checkpointing on the model with an
explicit use_reentrant X, then trains with TrainingArguments(gradient_checkpointing=True) and
no kwargs. The Trainer re-enables checkpointing and plain transformers replaces X with its own
default (True on 4.57, False on 5.x); with gcpatch the layers keep X.
"""

from __future__ import annotations

import pytest
from _asserts import assert_explained, assert_installed_gcpatch_ran, assert_plain, enable_records
from _run import V5, Spec, reentrant

SCRIPT = "trainer_reenable.py"
RUNS = [Spec(SCRIPT, ("--use-reentrant", x)) for x in ("false", "true")]
TRAINER_DEFAULT = not V5  # 4.57: gradient_checkpointing_enable(None) -> True; 5.x: False
ASKED = [pytest.param(False, id="use_reentrant=False"), pytest.param(True, id="use_reentrant=True")]


def _arg(value: bool) -> str:
    return "true" if value else "false"


@pytest.mark.parametrize("asked", ASKED)
def test_trainer_reenable_keeps_the_users_use_reentrant(script_runs, asked):
    run = script_runs.get(SCRIPT, "--use-reentrant", _arg(asked), gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["use_reentrant_before_trainer"] is asked
    assert r["use_reentrant_in_step"] is asked
    assert r["use_reentrant_after"] is asked
    assert r["trainable_grad_none"] == 0


@pytest.mark.parametrize("asked", ASKED)
def test_plain_trainer_reenable_replaces_the_users_use_reentrant_with_its_default(
    script_runs, asked
):
    run = script_runs.get(SCRIPT, "--use-reentrant", _arg(asked), gcpatch=False)
    assert_plain(run)
    r = run.result
    assert r["use_reentrant_before_trainer"] is asked
    assert reentrant(r["use_reentrant_in_step"]) is TRAINER_DEFAULT
    assert reentrant(r["use_reentrant_after"]) is TRAINER_DEFAULT


@pytest.mark.parametrize("asked", ASKED)
def test_trainer_reenable_is_recorded_as_x3(script_runs, asked):
    run = script_runs.get(SCRIPT, "--use-reentrant", _arg(asked), gcpatch=True)
    user, trainer = enable_records(run, "call"), enable_records(run, "trainer")
    assert len(user) == 1 and len(trainer) == 1, run.records()
    assert user[0]["asked"]["use_reentrant"] is asked and "X3" not in user[0]["asked"]["from"]
    rec = trainer[0]
    assert rec["asked"]["use_reentrant"] is asked
    assert "X3" in rec["asked"]["from"], rec["asked"]
    assert rec["applied"]["use_reentrant"] is asked
    assert rec["decision"]["winners"]["use_reentrant"]["rule"] == "USER"
    assert rec["decision"]["warnings"] == []
    # one INFO line per decision: the user's enable, then the Trainer's re-enable naming X3
    lines = run.gcpatch_lines()
    assert sum(" (trainer): " not in line for line in lines) == 1, run.stderr
    trainer_lines = [line for line in lines if " (trainer): " in line]
    assert len(trainer_lines) == 1 and "X3" in trainer_lines[0], run.stderr
    assert f"use_reentrant={asked} as asked" in trainer_lines[0], trainer_lines[0]
    assert_explained(run, "X3", f"use_reentrant={asked}")
