"""GCPATCH_MEMORY_BUDGET across the model-family table: every family (decoder-only, MoE, seq2seq,
audio, encoder-only, vision, two towers, VLMs, PEFT LoRA) trains three steps with checkpointing
enabled and each step's gradients match the model trained without checkpointing
(scripts/budget_families.py). The first step is probed from within (gcpatch/step/probe.py:
saved-tensor hooks around each layer's checkpoint, a dispatch mode in its forward), so every
tensor that step saves must reach its backward as it was; the second step runs the plan made at
its forward, the third the same plan again. Each family gets one budget line, and the VLMs are
planned at a batch of three rows, with their multimodal position_ids passed in."""

from __future__ import annotations

from _asserts import assert_installed_gcpatch_ran
from _families import FAMILIES
from _run import V5, Spec

SCRIPT = "budget_families.py"
BUDGET = {"GCPATCH_MEMORY_BUDGET": "0.5"}
# three rows: Qwen2-VL's images come flattened across them (pixel_values with image_grid_thw),
# the Qwen VLMs' multimodal position_ids passed in (sections x rows x tokens: gcpatch/step/batch.py);
# Qwen2.5-VL and Qwen3-VL merge 2 x 2 patches into a token (four pixel rows per placeholder)
VLMS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
THREE_ROWS = ("--rows", "3", "--positions", *VLMS)
RUNS = [Spec(SCRIPT, args, env=tuple(BUDGET.items())) for args in ((), THREE_ROWS)]


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


def test_vlms_are_planned_at_three_rows_with_their_position_ids_and_exact(script_runs):
    """Qwen2-VL (its images' patches one after the other across the rows), Qwen2.5-VL and Qwen3-VL
    (a placeholder token for four pixel rows) with their position_ids passed in, and LLaVA, at a
    batch of three rows: each probed at its first step, planned for three rows, and exact on every
    step. (The budget once ran its own forwards on the first rows, cutting the images and the
    position_ids with them; the probe reads the user's own step, whole.)"""
    run = script_runs.get(SCRIPT, *THREE_ROWS, gcpatch=True, env=BUDGET)
    assert run.result["rows"] == 3 and run.result["positions"]
    assert run.result["families"] == {name: {"error": None, "wrong": [0, 0, 0]} for name in VLMS}
    lines = [m for m in run.messages() if m.startswith("gcpatch: rank 0 budget ")]
    assert len(lines) == len(VLMS), lines
    assert all("layers checkpointed" in line for line in lines), lines
    assert _planned_rows(run) == [3] * len(VLMS), lines


def _planned_rows(run) -> list[int]:
    """The rows of the batch each first plan was made for (the second step's), from its record
    (the line may leave the shape out to stay within two rows)."""
    return [r["budget"]["shape"][0] for r in run.records() if r.get("stage") == "budget"]
