"""Scenario c (R5): a GPT2 with dropout built and left in eval mode (as from_pretrained leaves
it), gradient_checkpointing_enable(), forward+backward with grad enabled.

Plain transformers checkpoints only layers in training mode, so nothing is checkpointed: the
forward saves as much as without checkpointing (~12x what train mode saves). gcpatch makes the
layers checkpoint while their forward still runs in eval mode (dropout stays off).
"""

from __future__ import annotations

import pytest
from _asserts import assert_explained, assert_installed_gcpatch_ran, assert_plain, enable_records
from _run import TRANSFORMERS, V5, Spec
from packaging.version import Version

SCRIPT = "eval_mode_gpt2.py"
GENERATE = "eval_mode_generate.py"
RUNS = [Spec(SCRIPT), Spec(GENERATE)]
LAYERS = 4
# Which modules hold the checkpoint flag R5 sets: each layer once GPT2Block is a
# GradientCheckpointingLayer, the loop owner (GPT2Model, "transformer") before. transformers 4.52
# introduced that base class (Llama and others), GPT2Block got it in 4.53.0
# (transformers/models/gpt2/modeling_gpt2.py: `class GPT2Block(nn.Module)` in 4.52.4).
LEGACY = TRANSFORMERS < Version("4.53")
FLAGGED = ["transformer"] if LEGACY else [f"transformer.h.{i}" for i in range(LAYERS)]
FIXED = len(FLAGGED)
# The cached decode step of GENERATE builds its cache as Llama does from transformers 4.56 on
# (models/llama/modeling_llama.py: `DynamicCache(config=self.config)`); its keyword is `cache` from
# 5.24 (`@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")`).
NO_CACHED_STEP = (
    f"transformers {TRANSFORMERS}: the cached decode step builds DynamicCache(config=...), 4.56+"
    if TRANSFORMERS < Version("4.56")
    else ""
)
CACHE_KEYWORD = "cache" if TRANSFORMERS >= Version("5.24") else "past_key_values"


def test_eval_mode_model_checkpoints_and_saves_memory_like_train_mode(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["ratio_eval_gc_to_train_gc"] <= 1.1, r
    assert r["saved_bytes_eval_gc"] < r["saved_bytes_eval_nogc"] / 5, r


def test_eval_mode_fix_leaves_dropout_off_and_results_exact(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=True)
    r = run.result
    assert r["dropout_modules"] > 0
    assert r["dropout_flags_unchanged"] and r["dropout_all_off"], r
    assert r["loss_equal_eval_nogc"], r["loss_abs_diff"]
    assert r["grads_wrong"] == 0
    assert r["model_training"] is False  # the model itself is still in eval mode
    # what R5 changes: the checkpointed layers' own flag, and nothing else
    assert r["modules_training_flag_changed"] == FLAGGED


def test_plain_eval_mode_checkpointing_saves_nothing(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=False)
    assert_plain(run)
    r = run.result
    assert r["saved_bytes_eval_gc"] == r["saved_bytes_eval_nogc"]
    assert r["ratio_eval_gc_to_train_gc"] >= 5, r
    assert r["dropout_flags_unchanged"] and r["loss_equal_eval_nogc"]
    assert r["modules_training_flag_changed"] == []


def test_r5_decision_is_recorded_at_first_forward_and_explained(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=True)
    records = run.records()
    first = [rec for rec in records if rec.get("stage") == "first_forward"]
    assert len(first) == 1, records  # only the eval-mode model: the train-mode one needs no fix
    rec = first[0]
    if V5:  # transformers keeps the cache on in eval mode: R6 comes with R5 (on 4.x at the enable)
        assert sorted(rec["rules"]) == ["R5", "R6"]
        assert rec["applied"] == {
            "eval_mode_fix": FIXED,
            "use_cache_off": "use_cache True -> False",
        }
    else:
        assert rec["rules"] == ["R5"]
        assert rec["applied"] == {"eval_mode_fix": FIXED}
    assert rec["why"]["eval_mode_fix"].startswith("R5:")
    assert rec["facts"]["layers_in_eval_mode"] == FIXED and rec["facts"]["grad_enabled"] is True
    assert len(enable_records(run)) == 2  # the eval-mode model and the train-mode model
    assert any(
        f"{FIXED} eval-mode layers checkpoint anyway (R5" in line for line in run.gcpatch_lines()
    ), run.stderr
    assert_explained(run, "R5", f"eval_mode_fix={FIXED}")


def test_generate_after_eval_mode_fix_matches_the_unpatched_model(script_runs):
    # Regression: R5 once left the layers' own training flag set, so a later no_grad generate()
    # took transformers' checkpoint branch, which drops the KV cache -> different tokens.
    run = script_runs.get(GENERATE, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    assert run.result["tokens_equal"], run.result


def test_plain_generate_after_eval_mode_checkpointing_is_unchanged(script_runs):
    run = script_runs.get(GENERATE, gcpatch=False)
    assert_plain(run)
    assert run.result["tokens_equal"], run.result


@pytest.mark.skipif(bool(NO_CACHED_STEP), reason=NO_CACHED_STEP)
@pytest.mark.parametrize("gcpatch", [False, True], ids=["plain", "gcpatch"])
def test_grad_enabled_step_passing_only_a_kv_cache_keeps_it(script_runs, gcpatch):
    # R5 leaves a forward that extends a KV cache in the user's mode: a checkpointed layer would drop
    # the cache (GradientCheckpointingLayer sets it to None), so the step would attend to itself only.
    run = script_runs.get(GENERATE, gcpatch=gcpatch)
    r = run.result
    assert r["cache_keyword"] == CACHE_KEYWORD
    assert r["cached_step_equal"], r
