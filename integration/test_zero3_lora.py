"""DeepSpeed ZeRO-3 on CPU (one process, gloo, DS_ACCELERATOR=cpu, persistence
threshold 0, model built under zero.Init through HfDeepSpeedConfig), LoRA, 2 steps, with
use_reentrant False, unset and True, against the no-checkpointing run's losses.

DeepSpeed < 0.19.3: non-reentrant recompute of ZeRO-3-partitioned frozen parameters raises
CheckpointError; gcpatch's R3 applies reentrant + the input-grads hook even over the user's False.
0.19.3 (the fix): no R3, every choice works.
"""

from __future__ import annotations

import math
from importlib import metadata

import pytest

pytest.importorskip("peft")
pytest.importorskip("deepspeed")

from _asserts import (
    assert_explain_lists_every_decision,
    assert_installed_gcpatch_ran,
    assert_plain,  # noqa: E402
    final_enable_record,
    winner,
)
from _run import V5, Spec, outside_plugin_range  # noqa: E402
from packaging.version import Version  # noqa: E402

OUT_OF_RANGE = outside_plugin_range("peft")
pytestmark = [pytest.mark.zero3, pytest.mark.skipif(bool(OUT_OF_RANGE), reason=OUT_OF_RANGE)]

SCRIPT = "zero3_lora.py"
LAUNCH = "deepspeed1"
DEEPSPEED = Version(metadata.version("deepspeed"))
FIXED = DEEPSPEED >= Version("0.19.3")
CHOICES = ("false", "unset", "true")
RUNS = [Spec(SCRIPT, ("--reentrant", x), launcher=LAUNCH) for x in ("nogc", *CHOICES)]
ASKED = {"false": False, "unset": None, "true": True}

CHOICE = [pytest.param(x, id=f"use_reentrant={x}") for x in CHOICES]


def _get(script_runs, choice, gcpatch):
    return script_runs.get(SCRIPT, "--reentrant", choice, gcpatch=gcpatch, launcher=LAUNCH)


def _reference(script_runs):
    ref = _get(script_runs, "nogc", False).result
    assert ref["error"] is None and len(ref["losses"]) == 2 and ref["zero3_partitioned_at_build"]
    return ref["losses"]


def _expected(choice: str) -> tuple[bool, str]:
    """(applied use_reentrant, rule) the rules give on this DeepSpeed."""
    if not FIXED:
        return True, "R3"
    # LoRA freezes the base below the adapted blocks; R1 reads the deepspeed plugin's gate
    # (zero3_nonreentrant_recompute) and acts as it does without ZeRO-3: the embeddings feed the
    # stack, so R2's input-grads hook makes reentrant exact and R1 only recommends non-reentrant. An
    # unset ask gets R1's False; an explicit ask is the user's, kept (True: through the hook).
    if choice == "unset":
        return False, "R1"
    return ASKED[choice], "USER"


@pytest.mark.parametrize("choice", [pytest.param(x, id=f"use_reentrant={x}") for x in CHOICES])
def test_zero3_lora_finishes_with_the_no_checkpointing_losses(script_runs, choice):
    run = _get(script_runs, choice, True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["zero3_partitioned_at_build"]
    assert r["error"] is None, r["error"]
    assert all(
        math.isclose(a, b, abs_tol=1e-4) for a, b in zip(r["losses"], _reference(script_runs))
    ), r["losses"]
    assert len(r["losses"]) == 2


@pytest.mark.parametrize("choice", CHOICE)
def test_zero3_record_says_which_rule_chose(script_runs, choice):
    run = _get(script_runs, choice, True)
    applied, rule = _expected(choice)
    last = final_enable_record(run)
    assert last["facts"]["zero3"] is True and last["facts"]["peft"] is True
    assert last["asked"]["use_reentrant"] is ASKED[choice]
    assert last["applied"]["use_reentrant"] is applied
    assert run.result["applied_use_reentrant"] is applied
    assert winner(last) == rule
    if FIXED:
        assert all("R3" not in rec["rules"] for rec in run.records())
        if applied:  # the user's reentrant, exact through the hook (the losses test compares them)
            assert last["applied"]["input_grads_hook"] is True and "R2" in last["rules"]
    else:
        assert last["applied"]["input_grads_hook"] is True
        if choice == "false":  # fix mode: R3 over the user's False, with a warning
            assert any(
                v["rule"] == "USER" and v["value"] is False for v in last["decision"]["overruled"]
            )
            assert any("R3" in w for w in last["decision"]["warnings"])
    assert_explain_lists_every_decision(run)


@pytest.mark.parametrize("choice", CHOICES)
def test_plain_zero3_lora(script_runs, choice):
    run = _get(script_runs, choice, False)
    assert_plain(run)
    r = run.result
    crashes = not FIXED and (choice == "false" or (choice == "unset" and V5))
    if crashes:
        assert r["error"].startswith("CheckpointError"), r["error"]
        assert "Recomputed values" in r["error"]
    else:
        assert r["error"] is None, r["error"]
        assert all(
            math.isclose(a, b, abs_tol=1e-4) for a, b in zip(r["losses"], _reference(script_runs))
        )
