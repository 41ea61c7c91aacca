"""Verify mode wherever a first step happens: DDP on 2 ranks (gloo, CPU) around a checkpointed
model, the HF Trainer (one process, and 2 ranks under torchrun), TRL's SFTTrainer with LoRA.
Each rank verifies its own replica: no hang, one verify line per rank, and every rank's
all-reduced gradients, parameters, optimizer state and RNG stream bit-identical to the same run
without verify (a collective or a second all-reduce triggered by verify would change them or
hang)."""

from __future__ import annotations

import re

import pytest
from _asserts import assert_installed_gcpatch_ran
from _run import Spec

VERIFY = {"GCPATCH_VERIFY": "1"}
DDP = "verify_ddp.py"
TRAINER = "verify_trainer.py"
RUNS = (
    [
        Spec(DDP, ("--find-unused", f), env=e, launcher="torchrun2")
        for f in ("no", "yes")
        for e in (tuple(VERIFY.items()), ())
    ]
    + [
        Spec(TRAINER, ("--trainer", t), env=e)
        for t in ("hf", "sft")
        for e in (tuple(VERIFY.items()), ())
    ]
    + [
        Spec(TRAINER, ("--trainer", "hf"), env=e, launcher="torchrun2")
        for e in (tuple(VERIFY.items()), ())
    ]
)

KEYS = ("first_step_grads", "params_after", "rng_after", "losses")


def verify_lines(run) -> list[str]:
    return [line for line in run.messages() if re.match(r"gcpatch: rank \d+ verify ", line)]


def assert_one_matching_line_per_rank(run, ranks: int) -> None:
    lines = verify_lines(run)
    assert sorted(int(line.split()[2]) for line in lines) == list(range(ranks)), run.stderr[-3000:]
    for line in lines:
        assert "gradients match" in line and "each block recomputed once" in line, line
    by_rank = run.records_by_rank()
    for r in range(ranks):
        records = [e for e in by_rank[r] if e.get("stage") == "verify"]
        assert len(records) == 1 and records[0]["verify"]["gradients_match"], records


@pytest.mark.distributed
@pytest.mark.parametrize("find_unused", ["no", "yes"])
def test_ddp_two_ranks_verify_each_replica_without_touching_the_step(script_runs, find_unused):
    run = script_runs.get(
        DDP, "--find-unused", find_unused, gcpatch=True, env=VERIFY, launcher="torchrun2"
    )
    assert_installed_gcpatch_ran(run)
    assert [r["rank"] for r in run.results] == [0, 1]
    # no: reentrant kept (verify's own backward runs reentrant under DDP); yes: R4 made it non-reentrant
    assert run.result["applied_use_reentrant"] is (find_unused == "no")
    assert_one_matching_line_per_rank(run, 2)
    without = script_runs.get(DDP, "--find-unused", find_unused, gcpatch=True, launcher="torchrun2")
    assert verify_lines(without) == []
    for got, ref in zip(run.results, without.results):
        for key in KEYS + ("optimizer_state",):
            assert got[key] == ref[key], (got["rank"], key)
    # all-reduced: both ranks end with the same gradients and weights
    assert run.results[0]["first_step_grads"] == run.results[1]["first_step_grads"]


@pytest.mark.parametrize("trainer", ["hf", "sft"])
def test_trainers_verify_once_and_train_identically(script_runs, trainer):
    run = script_runs.get(TRAINER, "--trainer", trainer, gcpatch=True, env=VERIFY)
    assert_installed_gcpatch_ran(run)
    assert_one_matching_line_per_rank(run, 1)
    rep = [e for e in run.records() if e.get("stage") == "verify"][0]["verify"]
    assert rep["tensors"] == run.result["trainable"]  # every trainable tensor compared (LoRA: 8)
    without = script_runs.get(TRAINER, "--trainer", trainer, gcpatch=True)
    for key in KEYS:
        assert run.result[key] == without.result[key], key


@pytest.mark.distributed
def test_trainer_on_two_ranks_one_verify_line_per_rank(script_runs):
    run = script_runs.get(
        TRAINER, "--trainer", "hf", gcpatch=True, env=VERIFY, launcher="torchrun2"
    )
    assert_one_matching_line_per_rank(run, 2)
    without = script_runs.get(TRAINER, "--trainer", "hf", gcpatch=True, launcher="torchrun2")
    for got, ref in zip(run.results, without.results):
        for key in KEYS:
            assert got[key] == ref[key], (got["rank"], key)
