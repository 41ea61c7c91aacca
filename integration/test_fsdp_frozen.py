"""accelerate's FSDP plugin (FSDP2, reshard_after_forward) on 2 gloo CPU ranks, checkpointing
enabled before `accelerator.prepare` as the Trainer does (integration/scripts/fsdp_frozen.py).

- A partially frozen model (embeddings and layer 0 frozen, inputs_embeds), reentrant asked: plain,
  layer 1 gets no gradient on either rank; with gcpatch the user's reentrant is kept with R2's
  input-grads hook on inputs_embeds, the decision is taken again when `fully_shard` wraps the model
  (F1, `fsdp: fsdp2` in the record) and every trainable tensor's full gradient equals the
  no-checkpointing, unsharded run's.
- FSDP's own activation checkpointing (accelerate's `activation_checkpointing`, checkpoint_wrapper)
  on top is a fact in the record and the gradients stay exact.
- With the checkpoint inside the FSDP unit (GradientCheckpointingLayer, this file's 5.x stack) and
  no forward prefetch (accelerate's FSDP2), reentrant costs no extra all-gather: an all-trainable
  model does the same all-gathers in backward with either variant. Where it does cost one, F2
  decides (integration/test_fsdp_all_gather.py).
"""

from __future__ import annotations

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain, winner
from _run import V5, Spec

pytest.importorskip("accelerate")
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not V5, reason="FSDP2 through accelerate 1.x: the 5.x stack"),
]

SCRIPT = "fsdp_frozen.py"
LAUNCH = "torchrun2"
FROZEN = ("--reentrant", "true", "--model", "frozen")
FSDP_AC = ("--reentrant", "true", "--model", "frozen", "--fsdp-ac")
ALL_TRUE = ("--reentrant", "true", "--model", "all")
ALL_FALSE = ("--reentrant", "false", "--model", "all")
RUNS = [Spec(SCRIPT, args, launcher=LAUNCH) for args in (FROZEN, FSDP_AC, ALL_TRUE, ALL_FALSE)]


def _get(script_runs, args, gcpatch):
    return script_runs.get(SCRIPT, *args, gcpatch=gcpatch, launcher=LAUNCH)


def test_plain_partially_frozen_reentrant_under_fsdp_loses_layer_gradients(script_runs):
    run = _get(script_runs, FROZEN, False)
    assert_plain(run)
    for r in run.results:
        assert r["error"] is None and r["model_class"] == "FSDPLlamaForCausalLM"
        assert r["applied_use_reentrant"] is True
        assert r["wrong"] == 9 and all(n.startswith("model.layers.1.") for n in r["wrong_names"]), (
            r["wrong_names"]
        )


@pytest.mark.parametrize(
    "args", [FROZEN, FSDP_AC], ids=["hf-checkpointing", "with-fsdp-checkpoint-wrapper"]
)
def test_partially_frozen_under_accelerate_fsdp_gets_exact_gradients(script_runs, args):
    run = _get(script_runs, args, True)
    assert_installed_gcpatch_ran(run)
    assert len(run.results) == 2
    for r in run.results:
        assert r["error"] is None, r["error"]
        assert r["trainable"] == 11 and r["wrong"] == 0, r["wrong_names"]
        assert r["applied_use_reentrant"] is True  # the user's, exact through R2's hook
    for rank in (0, 1):
        records = [
            rec for rec in run.records() if rec.get("stage") == "enable" and rec.get("rank") == rank
        ]
        assert records[0]["facts"]["fsdp"] == ""  # enabled before accelerate wraps the model
        last = records[-1]
        assert "F1" in last["source"], last["source"]
        assert "fsdp2" in last["facts"]["fsdp"] and winner(last) == "USER" and "R2" in last["rules"]
        if "--fsdp-ac" in args:
            # the wrappers accelerate put in, counted by the script on the prepared model
            wrapped = run.results[rank]["checkpoint_wrappers"]
            assert wrapped >= 2
            assert any(
                rec["facts"]["fsdp_checkpointing"].startswith(
                    f"checkpoint_wrapper: {wrapped} modules"
                )
                for rec in records
            ), [rec["facts"]["fsdp_checkpointing"] for rec in records]


def test_fsdp2_reentrant_inside_the_unit_costs_no_extra_all_gather(script_runs):
    reentrant = _get(script_runs, ALL_TRUE, False).results
    non_reentrant = _get(script_runs, ALL_FALSE, False).results
    for a, b in zip(reentrant, non_reentrant):
        assert a["error"] is None and b["error"] is None and a["wrong"] == 0 and b["wrong"] == 0
        assert a["backward_all_gathers"] == b["backward_all_gathers"] > 0, (a, b)
        assert a["forward_all_gathers"] == b["forward_all_gathers"] > 0
