"""The user's "off" is final and leaves no trace (scripts/disable_after_enable.py): enable then
disable (train mode; eval mode after R5 took effect; reentrant asked on a frozen embedding, so R1
and R2 acted), peft's `prepare_model_for_kbit_training(use_gradient_checkpointing=False)` and
`Trainer(gradient_checkpointing=False)` leave the model as the same script leaves it without
gcpatch: the same config (R6's `use_cache` given back on every config it switched off), no hook,
the same training flags, and the same saved activation bytes and gradients in the next step.
"""

from __future__ import annotations

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import Spec

SCRIPT = "disable_after_enable.py"
RUNS = [Spec(SCRIPT)]
SCENARIOS = (
    "enable_disable",
    "enable_disable_eval",
    "reentrant_disable",
    "kbit_false",
    "trainer_false",
)
FIGURES = (
    "saved_bytes",
    "loss",
    "config",
    "use_cache",
    "checkpointing",
    "training_flags",
    "hooks",
    "grad_sum",
)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_off_leaves_the_model_as_without_gcpatch(script_runs, scenario):
    gc, plain = script_runs.get(SCRIPT, gcpatch=True), script_runs.get(SCRIPT, gcpatch=False)
    assert_installed_gcpatch_ran(gc)
    assert_plain(plain)
    got, want = gc.result["results"][scenario], plain.result["results"][scenario]
    for figure in FIGURES:
        assert got[figure] == want[figure], (scenario, figure, got[figure], want[figure])
    assert got["checkpointing"] in ([False], []), got["checkpointing"]
    if scenario.endswith("disable") or scenario.endswith("disable_eval"):
        # never switched (transformers drops the cache itself in train mode), or switched by R6 at
        # the eval-mode first forward and given back by the disable
        assert got["use_cache"] is True


def test_disable_says_what_it_gave_back(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=True)
    lines = [
        line
        for line in run.stderr.splitlines()
        if "disable" in line and line.startswith("gcpatch: ")
    ]
    assert any("use_cache False -> True on config" in line for line in lines), run.stderr[-3000:]


def test_every_disable_of_a_decided_model_is_recorded(script_runs):
    """The disable goes through the same path as the enable, so `gcpatch explain` shows it."""
    run = script_runs.get(SCRIPT, gcpatch=True)
    disables = [e for e in run.records() if e.get("stage") == "disable"]
    # enable_disable, enable_disable_eval and reentrant_disable switch off a model gcpatch decided for
    assert len(disables) >= 3, [e.get("stage") for e in run.records()]
    assert all(e["api"].endswith("checkpointing_disable") for e in disables), disables
    assert any(e["restored"].get("config") == "use_cache False -> True" for e in disables), disables
