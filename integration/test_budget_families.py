"""GCPATCH_MEMORY_BUDGET across the model-family table: every family (decoder-only, MoE, seq2seq,
audio, encoder-only, vision, two towers, VLMs, PEFT LoRA) trains three steps with checkpointing
enabled and each step's gradients match the model trained without checkpointing
(scripts/budget_families.py). The plan is measured between the first forward and its backward, so
the measuring forwards must leave every tensor that forward saved as it was: Gemma's embedding
normalizer and BERT's, CLIP's and LLaVA's index buffers once came back with a new version and the
first backward was refused ('modified by an inplace operation'). Each family gets one budget line."""

from __future__ import annotations

from _asserts import assert_installed_gcpatch_ran
from _families import FAMILIES
from _run import V5, Spec

SCRIPT = "budget_families.py"
BUDGET = {"GCPATCH_MEMORY_BUDGET": "0.5"}
# three rows: Qwen2-VL's first rows run with the images they stand for (gcpatch/step/media.py)
THREE_ROWS = ("--rows", "3", "qwen2_vl", "llava")
# and with its multimodal position_ids passed in (sections x rows x tokens: gcpatch/step/batch.py)
POSITIONS = ("--rows", "3", "--positions", "qwen2_vl")
# Qwen2.5-VL and Qwen3-VL merge 2 x 2 patches into a token: four pixel rows per placeholder
MERGED = ("--rows", "3", "--positions", "qwen2_5_vl", "qwen3_vl")
RUNS = [
    Spec(SCRIPT, args, env=tuple(BUDGET.items())) for args in ((), THREE_ROWS, POSITIONS, MERGED)
]


def _families(script_runs, gcpatch: bool) -> tuple:
    """The run of the whole table and its per-family results."""
    run = script_runs.get(SCRIPT, gcpatch=gcpatch, env=BUDGET if gcpatch else None)
    families = run.result["families"]
    assert sorted(families) == sorted(FAMILIES)
    return run, families


def test_every_family_trains_exactly_under_a_budget(script_runs):
    run, families = _families(script_runs, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    off = {n: r for n, r in families.items() if r["error"] or r["wrong"] != [0, 0, 0]}
    assert not off, off
    # The same script plainly: on 4.x transformers' reentrant default fails PEFT LoRA (no input
    # requires grad) and Whisper (a second backward through the encoder's graph), as it does
    # without a budget; on 5.x (non-reentrant) plain is exact. The script tells the two apart.
    _, plain = _families(script_runs, gcpatch=False)
    plain_off = {n for n, r in plain.items() if r["error"] or r["wrong"] != [0, 0, 0]}
    assert plain_off == (set() if V5 else {"peft_lora", "whisper"}), plain


def test_each_family_is_planned_or_told_why_not(script_runs):
    run, _ = _families(script_runs, gcpatch=True)
    lines = [m for m in run.messages() if m.startswith("gcpatch: rank 0 budget ")]
    assert len(lines) == len(FAMILIES), lines
    unplanned = [line for line in lines if "layers checkpointed" not in line]
    assert unplanned == [], unplanned


def test_a_vlm_whose_images_come_flattened_across_rows_is_planned_at_any_batch(script_runs):
    """Qwen2-VL's pixel_values hold every image's patches one after the other: a batch of three
    rows is measured on its first rows with their own images, planned, and exact."""
    run = script_runs.get(SCRIPT, *THREE_ROWS, gcpatch=True, env=BUDGET)
    assert run.result["rows"] == 3
    assert run.result["families"] == {
        name: {"error": None, "wrong": [0, 0, 0]} for name in ("qwen2_vl", "llava")
    }
    lines = [m for m in run.messages() if m.startswith("gcpatch: rank 0 budget ")]
    assert len(lines) == 2, lines
    assert all("layers checkpointed" in line for line in lines), lines
    assert _planned_rows(run) == [3] * len(lines), lines


def test_a_vlms_multimodal_position_ids_are_cut_with_its_rows(script_runs):
    """Qwen2-VL's position_ids passed in are sections x rows x tokens: the measuring pass takes
    the first rows from their second dimension. Cut on the first (the sections), the pass failed
    (`mat1 and mat2 shapes cannot be multiplied`) and no plan was made."""
    run = script_runs.get(SCRIPT, *POSITIONS, gcpatch=True, env=BUDGET)
    assert run.result["rows"] == 3 and run.result["positions"]
    assert run.result["families"] == {"qwen2_vl": {"error": None, "wrong": [0, 0, 0]}}
    [line] = [m for m in run.messages() if m.startswith("gcpatch: rank 0 budget ")]
    assert "layers checkpointed" in line and _planned_rows(run) == [3], line


def test_vlms_that_merge_patches_into_a_token_are_planned_at_any_batch(script_runs):
    """Qwen2.5-VL and Qwen3-VL (spatial_merge_size 2: a placeholder token stands for four pixel
    rows), three rows with their position_ids passed in: each first row gets its own image's
    patches, planned, and exact."""
    run = script_runs.get(SCRIPT, *MERGED, gcpatch=True, env=BUDGET)
    assert run.result["families"] == {
        name: {"error": None, "wrong": [0, 0, 0]} for name in ("qwen2_5_vl", "qwen3_vl")
    }
    lines = [m for m in run.messages() if m.startswith("gcpatch: rank 0 budget ")]
    assert len(lines) == 2, lines
    assert all("layers checkpointed" in line for line in lines), lines
    assert _planned_rows(run) == [3] * len(lines), lines


def _planned_rows(run) -> list[int]:
    """The rows of the batch each first plan was made at, from its record (the line may leave the
    shape out to stay within two rows)."""
    return [r["budget"]["shape"][0] for r in run.records() if r.get("stage") == "budget"]
