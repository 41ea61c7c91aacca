"""X6: Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE trained on an image batch without an
attention_mask (scripts/mrope_mask.py). On transformers 4.57-5.2 their text model, given no mask
and no cache, builds its causal mask from the multimodal rope's temporal row, and masking_utils reads each
image's still positions as a new packed sequence (transformers#44158, fixed in 5.3.0).
Checkpointing turns the cache off in a training forward, so plain checkpointing changes every
gradient; R6 turns it off in the config, so an evaluation forward would change too. gcpatch hands
such a forward a mask of ones: gradients and evaluation logits as without checkpointing, said in
one line. A packing collator's 2-D position_ids are the user's packing: left as given, the
checkpointed gradients are plain's to the bit. On 5.3 and later nothing is patched and both runs
are exact. Qwen3.5 is in CI on 5.24 only; on 5.2.0, its one affected release, a venv with
transformers==5.2.0 beside torch 2.13 runs this file as it is (plain: 47 of Qwen3.5's 61 gradients
wrong, 55 of its MoE's 69; gcpatch 0).
"""

from __future__ import annotations

import importlib.util

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import TRANSFORMERS, Spec
from packaging.specifiers import SpecifierSet
from packaging.version import Version

SCRIPT = "mrope_mask.py"
# Qwen3.5 (hybrid linear and full attention) came with transformers 5.2: a 4.x env skips it
QWEN3_5 = importlib.util.find_spec("transformers.models.qwen3_5") is not None
MODELS = ("qwen3_vl", "qwen3_vl_moe") + (("qwen3_5", "qwen3_5_moe") if QWEN3_5 else ())
PACKED = ("--model", "qwen3_vl", "--packed")
RUNS = [Spec(SCRIPT, ("--model", name)) for name in MODELS] + [Spec(SCRIPT, PACKED)]
OUT_OF_RANGE = "Qwen3-VL came with transformers 4.57" if TRANSFORMERS < Version("4.57") else ""
AFFECTED = TRANSFORMERS in SpecifierSet(">=4.57,<5.3")
TEXT_MODEL = {
    "qwen3_vl": "Qwen3VLTextModel",
    "qwen3_vl_moe": "Qwen3VLMoeTextModel",
    "qwen3_5": "Qwen3_5TextModel",
    "qwen3_5_moe": "Qwen3_5MoeTextModel",
}
TRAINABLE = {"qwen3_vl": 64, "qwen3_vl_moe": 64, "qwen3_5": 61, "qwen3_5_moe": 69}
# of the trainable tensors, plain checkpointing changed: Qwen3-VL 64, its MoE 60 (4.57.6), Qwen3.5
# 47, its MoE 55 (5.2.0, the one affected release that has them; not in CI's matrix)
PLAIN_WRONG = {"qwen3_vl": 50, "qwen3_vl_moe": 50, "qwen3_5": 40, "qwen3_5_moe": 40}

pytestmark = pytest.mark.skipif(bool(OUT_OF_RANGE), reason=OUT_OF_RANGE)


@pytest.mark.parametrize("model", MODELS)
def test_a_batch_without_a_mask_trains_and_evaluates_as_without_checkpointing(script_runs, model):
    run = script_runs.get(SCRIPT, "--model", model, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["wrong"] == 0 and r["trainable"] == TRAINABLE[model], r
    assert r["eval_max_diff"] == 0.0, r
    lines = [m for m in run.messages() if "(X6)" in m]
    if AFFECTED:
        assert len(lines) == 1 and lines[0].startswith(f"gcpatch: {TEXT_MODEL[model]}: "), lines
        assert "transformers#44158" in lines[0], lines
        assert any("X6" in e.get("rules", ()) for e in run.records()), run.records()
    else:
        assert lines == [], lines


@pytest.mark.parametrize("model", MODELS)
def test_plain_checkpointing_changes_the_gradients_where_transformers_reads_images_as_packed(
    script_runs, model
):
    """What the gcpatch test proves against: plain checkpointing is wrong on the affected
    releases (the cache it turns off), exact after transformers#44158."""
    run = script_runs.get(SCRIPT, "--model", model, gcpatch=False)
    assert_plain(run)
    r = run.result
    if AFFECTED:
        assert r["wrong"] >= PLAIN_WRONG[model], r
    else:
        assert r["wrong"] == 0, r
    assert r["eval_max_diff"] == 0.0, r  # plain leaves the config's cache on


def test_a_packing_collators_positions_are_left_as_given(script_runs):
    """2-D position_ids that restart along a row are the user's packing: the checkpointed run
    masks by them, plainly and under gcpatch alike (no X6 mask), to the bit."""
    ours = script_runs.get(SCRIPT, *PACKED, gcpatch=True)
    plain = script_runs.get(SCRIPT, *PACKED, gcpatch=False)
    assert_installed_gcpatch_ran(ours)
    assert ours.result["grad_digest"] == plain.result["grad_digest"], (ours.result, plain.result)
    assert ours.result["wrong"] == plain.result["wrong"], (ours.result, plain.result)
    assert not [m for m in ours.messages() if "(X6)" in m]
