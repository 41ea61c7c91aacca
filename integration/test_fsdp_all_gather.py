"""F2: reentrant recompute outside an FSDP unit all-gathers the unit again in backward
(transformers#30404, pytorch#105635), counted on 2 gloo CPU ranks (integration/scripts/fsdp_all_gather.py:
FSDP1 FULL_SHARD, and FSDP2 with forward prefetch, each decoder layer its own unit, a 2-layer Llama).

- Model families that predate transformers' GradientCheckpointingLayer (Llama before 4.52) call the
  checkpoint around the wrapped layer: plain, transformers 4.x's default (reentrant) all-gathers in
  backward more often than no checkpointing (FSDP1: once more per layer; FSDP2: its forward prefetch
  runs again). With gcpatch, F2 picks non-reentrant: as many all-gathers as without checkpointing,
  every gradient equal to the unsharded no-checkpointing run's. An explicit reentrant ask is kept (it
  is correct) and the record tells the cost.
- From 4.52 the checkpoint runs inside the unit: reentrant costs nothing extra, and F2 does not vote.
"""
from __future__ import annotations

import pytest
from packaging.version import Version

from _asserts import assert_installed_gcpatch_ran, assert_plain, winner
from _run import TRANSFORMERS, Spec

pytestmark = pytest.mark.distributed

SCRIPT = "fsdp_all_gather.py"
LAUNCH = "torchrun2"
# LlamaDecoderLayer became a GradientCheckpointingLayer in transformers 4.52 (transformers/modeling_layers.py)
OUTSIDE = TRANSFORMERS < Version("4.52")
LAYERS = 2
FSDP1 = ("--fsdp", "1")
FSDP2 = ("--fsdp", "2")
ASKS = ("none", "true", "nogc") if OUTSIDE else ("true", "nogc")
RUNS = [Spec(SCRIPT, (*kind, "--ask", ask), launcher=LAUNCH) for kind in (FSDP1, FSDP2) for ask in ASKS]
outside_only = pytest.mark.skipif(not OUTSIDE, reason=f"transformers {TRANSFORMERS}: Llama's checkpoint runs "
                                  "inside the FSDP unit (GradientCheckpointingLayer, 4.52+)")
inside_only = pytest.mark.skipif(OUTSIDE, reason=f"transformers {TRANSFORMERS}: Llama's checkpoint wraps the "
                                 "FSDP unit from outside (before GradientCheckpointingLayer, 4.52)")


def _results(script_runs, kind, ask, gcpatch):
    run = script_runs.get(SCRIPT, *kind, "--ask", ask, gcpatch=gcpatch, launcher=LAUNCH)
    assert len(run.results) == 2, run.describe()
    for r in run.results:
        assert r["wrong"] == 0 and r["trainable"] == 21, r["wrong_names"]  # every gradient exact, every run
        assert r["checkpoint_inside_unit"] is not OUTSIDE
    return run


def _backward(run) -> list[int]:
    return [r["backward_all_gathers"] for r in run.results]


@outside_only
@pytest.mark.parametrize("kind", [FSDP1, FSDP2], ids=["fsdp1", "fsdp2-prefetch"])
def test_plain_default_reentrant_all_gathers_again_in_backward(script_runs, kind):
    plain = _results(script_runs, kind, "none", False)
    assert_plain(plain)
    # transformers 4.x's default is reentrant: use_reentrant=True, or on 4.35 nothing passed (torch's default)
    assert all(r["applied_use_reentrant"] in (True, "unset") for r in plain.results)
    without = _backward(_results(script_runs, kind, "nogc", False))
    extra = [a - b for a, b in zip(_backward(plain), without)]
    assert extra == ([LAYERS, LAYERS] if kind == FSDP1 else [LAYERS - 1, LAYERS - 1]), (_backward(plain), without)


@outside_only
@pytest.mark.parametrize("kind", [FSDP1, FSDP2], ids=["fsdp1", "fsdp2-prefetch"])
def test_gcpatch_all_gathers_as_without_checkpointing(script_runs, kind):
    run = _results(script_runs, kind, "none", True)
    assert_installed_gcpatch_ran(run)
    assert all(r["applied_use_reentrant"] is False for r in run.results)
    assert _backward(run) == _backward(_results(script_runs, kind, "nogc", False))
    last = [rec for rec in run.records() if rec.get("stage") == "enable"][-1]
    assert winner(last) == "F2" and last["facts"]["fsdp"] == ("fsdp1" if kind == FSDP1 else "fsdp2")


@outside_only
def test_an_explicit_reentrant_ask_is_kept_and_told_the_cost(script_runs):
    plain = _results(script_runs, FSDP1, "true", False)
    run = _results(script_runs, FSDP1, "true", True)
    assert all(r["applied_use_reentrant"] is True for r in run.results)
    assert _backward(run) == _backward(plain)  # the cost the user chose, nothing else changed
    last = [rec for rec in run.records() if rec.get("stage") == "enable"][-1]
    assert winner(last) == "USER"
    told = [w for w in last["decision"]["warnings"] if w.startswith("F2:")]
    assert told and "all-gathered twice" in told[0] and "is kept" in told[0], last["decision"]["warnings"]


@inside_only
@pytest.mark.parametrize("kind", [FSDP1, FSDP2], ids=["fsdp1", "fsdp2-prefetch"])
def test_inside_the_unit_reentrant_costs_nothing_and_f2_stays_out(script_runs, kind):
    plain = _results(script_runs, kind, "true", False)
    assert _backward(plain) == _backward(_results(script_runs, kind, "nogc", False))
    run = _results(script_runs, kind, "true", True)
    assert all(r["applied_use_reentrant"] is True for r in run.results)
    for rec in run.records():
        rules = {v["rule"] for v in rec.get("decision", {}).get("votes", [])} | {
            w[:2] for w in rec.get("decision", {}).get("warnings", [])}
        assert "F2" not in rules, rec
