"""One input-grads hook per model, however often checkpointing or input grads are enabled (X2).

transformers 5.23's `enable_input_require_grads` registers a new forward hook on the input
embeddings at every call (its own enable calls it for input_ids models, peft and TRL call it again,
trl#480) and keeps the handle of the last one only: plainly, a double enable leaves two hooks and a
third call three, and `disable_input_require_grads` removes one of them. Under gcpatch each call
leaves exactly one, counting transformers' own hook and gcpatch's R2 hook (which steps aside where
transformers' sits on the same embedding, and comes back when that one is disabled while R2 still
needs it). Gradients are compared with a no-checkpointing reference."""

from __future__ import annotations

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import TRANSFORMERS, Spec, outside_plugin_range

OUT_OF_RANGE = (
    "the hook-per-call behaviour measured here is transformers 5.x's"
    if TRANSFORMERS.major < 5
    else outside_plugin_range("peft")
)
pytestmark = pytest.mark.skipif(bool(OUT_OF_RANGE), reason=OUT_OF_RANGE)
SCRIPT = "input_grads_hooks.py"
RUNS = [
    Spec(SCRIPT, ("--case", "double")),
    Spec(SCRIPT, ("--case", "double"), env=(("GCPATCH_MODE", "warn"),)),
    Spec(SCRIPT, ("--case", "sft")),
]


def test_double_enable_leaves_one_hook(script_runs):
    plain = script_runs.get(SCRIPT, "--case", "double", gcpatch=False)
    run = script_runs.get(SCRIPT, "--case", "double", gcpatch=True)
    assert_plain(plain)
    assert_installed_gcpatch_ran(run)
    p, g = plain.result["hooks"], run.result["hooks"]
    # plainly: one more hook per enable, and a disable leaves the stale ones
    assert (p["after_enable_1"], p["after_enable_2"], p["after_enable_input_require_grads"]) == (
        1,
        2,
        3,
    ), p
    assert p["after_disable_input_require_grads"] == 2, p
    # gcpatch: one after every call; the user's reentrant is kept (the hook makes it exact, R1 only
    # recommends), so when the user disables transformers' hook gcpatch's own takes its place
    assert (g["after_enable_1"], g["after_enable_2"], g["after_enable_input_require_grads"]) == (
        1,
        1,
        1,
    ), g
    assert (
        g["after_disable_input_require_grads"] == 1 and run.result["applied_use_reentrant"] is True
    ), g
    assert plain.result["wrong"] == [] and run.result["wrong"] == []


def test_reentrant_kept_has_one_hook_and_gets_it_back_after_a_disable(script_runs):
    """warn mode keeps the user's reentrant as fix mode does: R2 needs the hook. transformers' hook is
    the one while it is there; gcpatch's own replaces it when the user disables transformers' (one, not zero)."""
    run = script_runs.get(SCRIPT, "--case", "double", gcpatch=True, env={"GCPATCH_MODE": "warn"})
    assert_installed_gcpatch_ran(run)
    g = run.result["hooks"]
    assert run.result["applied_use_reentrant"] is True
    assert (g["after_enable_1"], g["after_enable_2"], g["after_enable_input_require_grads"]) == (
        1,
        1,
        1,
    ), g
    assert g["after_disable_input_require_grads"] == 1, g
    assert run.result["wrong"] == [], run.result[
        "wrong"
    ]  # every LoRA gradient equals the reference's


def test_trl_sft_trainer_leaves_one_hook(script_runs):
    if outside_plugin_range("trl"):
        pytest.skip(outside_plugin_range("trl"))
    plain = script_runs.get(SCRIPT, "--case", "sft", gcpatch=False)
    run = script_runs.get(SCRIPT, "--case", "sft", gcpatch=True)
    assert_plain(plain)
    assert_installed_gcpatch_ran(run)
    assert plain.result["hooks"]["after_train"] >= 2, plain.result[
        "hooks"
    ]  # TRL's enable + the Trainer's
    assert run.result["hooks"] == {"after_init": 1, "after_train": 1}, run.result["hooks"]
