"""R5 wherever the forward goes (scripts/eval_mode_paths.py): a model left in eval mode checkpoints
whichever path reaches its layers, because the eval-mode fix is armed on the module that runs the
checkpointed blocks, not only on the model's own `__call__`. Calling `model.forward(...)` directly,
or through a wrapper that calls the inner model's `forward` (peft <= 0.13's `BaseTuner.forward`,
the path of ColossalAI's `booster.enable_lora`), bypasses the model's hooks: an R5 armed there
alone never fires and the layers save as much as without checkpointing. A head that reads
`config.use_cache` before its stack runs (transformers 5.2.0's T5, BART and Whisper heads; 5.24's
stacks read it themselves) hands the stack a cache asked for: an R5 armed on the stack alone stood
aside there as for a user's own ask, so R5 is armed on the model too, and decides before the head
reads the config (R6 switches the cache off first).
"""

from __future__ import annotations

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import V5, Spec

SCRIPT = "eval_mode_paths.py"
RUNS = [Spec(SCRIPT)]
PATHS = ("call", "forward", "tuner", "peft_first", "config_first")


@pytest.mark.parametrize("path", PATHS)
def test_eval_mode_checkpoints_on_every_path(script_runs, path):
    run = script_runs.get(SCRIPT, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result["paths"][path]
    assert 0.9 <= r["ratio_eval_to_train"] <= 1.1, r  # saved bytes, eval vs train mode, within 10%
    assert r["saved_eval_gc"] < r["saved_eval_nogc"] / 3, r
    assert r["grads_wrong"] == 0 and r["trainable"] > 0, r
    assert r["model_training"] is False


@pytest.mark.parametrize("path", PATHS)
def test_plain_eval_mode_checkpoints_nothing_on_any_path(script_runs, path):
    run = script_runs.get(SCRIPT, gcpatch=False)
    assert_plain(run)
    r = run.result["paths"][path]
    assert r["ratio_eval_to_train"] > 3, r
    assert r["grads_wrong"] == 0


def test_r5_is_recorded_once_per_model_on_the_direct_paths(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=True)
    first = [r for r in run.records() if r.get("stage") == "first_forward"]
    # one per eval-mode model with checkpointing (one per path); the train-mode ones need no fix
    assert len(first) == len(PATHS), [r.get("model") for r in first]
    assert all(r["applied"]["eval_mode_fix"] == 2 for r in first), first
    # 5.x: R6 comes with R5 where a config has the cache on (transformers keeps it on in eval
    # mode); 4.x switched it at the enable
    for r in first:
        assert sorted(r["rules"]) == (["R5", "R6"] if V5 else ["R5"]), r["rules"]
        assert ("use_cache_off" in r["applied"]) is V5, r["applied"]
