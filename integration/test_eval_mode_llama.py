"""R5 on a Llama left in eval mode, on every release. Before transformers 4.52 the loop owner
(`LlamaModel`) holds the checkpoint flag, and on 4.43-4.44 its forward also reads `self.training`
for the legacy-cache conversion; R5 must still take effect there (saved bytes as in train mode)
without changing what the model computes (same loss and gradients as eval mode without
checkpointing, attention dropout off).
"""

from __future__ import annotations

from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import Spec

SCRIPT = "eval_mode_gpt2.py"
ARGS = ("--model", "llama")
RUNS = [Spec(SCRIPT, ARGS)]


def test_eval_mode_llama_checkpoints_like_train_mode_with_the_same_results(script_runs):
    run = script_runs.get(SCRIPT, *ARGS, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    # R5's claim: the model left in eval mode checkpoints as it would in train mode (the plain run
    # saves what no checkpointing saves, see below)
    assert 0.9 <= r["ratio_eval_gc_to_train_gc"] <= 1.1, r
    # ... which saves memory wherever train-mode checkpointing does. Not on every release at this
    # size: on 4.38.2 train-mode checkpointing itself saves 134 MB against 0.6 MB without it (the
    # layers get the model's full causal mask as a checkpoint input), measured by this script.
    if r["saved_bytes_train_gc"] < r["saved_bytes_eval_nogc"] / 2:
        assert r["saved_bytes_eval_gc"] < r["saved_bytes_eval_nogc"] / 2, r
    assert r["loss_equal_eval_nogc"], r["loss_abs_diff"]
    assert r["grads_wrong"] == 0, r
    assert r["model_training"] is False
    assert r["modules_training_flag_changed"], (
        r
    )  # the loop owner's (or the layers') own flag, nothing else


def test_plain_eval_mode_llama_checkpoints_nothing(script_runs):
    run = script_runs.get(SCRIPT, *ARGS, gcpatch=False)
    assert_plain(run)
    r = run.result
    assert r["saved_bytes_eval_gc"] == r["saved_bytes_eval_nogc"], r
    assert r["saved_bytes_eval_gc"] != r["saved_bytes_train_gc"], (
        r
    )  # so the gcpatch test's ratio can fail
    assert r["loss_equal_eval_nogc"] and r["modules_training_flag_changed"] == []
