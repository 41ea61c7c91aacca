"""Scenario a (R1): a partially frozen Llama checkpointed with use_reentrant=True.

Plain transformers gives the trainable layer behind the frozen ones no gradient (reentrant
checkpoint of a block whose inputs need no grad): on 4.57 for input_ids and inputs_embeds, on
5.x only for inputs_embeds (5.x hooks the embedding output for input_ids models, X2).
gcpatch's R1 switches to non-reentrant and every gradient matches the reference.
"""
from __future__ import annotations

import pytest

from _asserts import assert_explained, assert_installed_gcpatch_ran, assert_plain, enable_records
from packaging.version import Version

from _run import TRANSFORMERS, V5, Spec

SCRIPT = "frozen_llama.py"
TRAINABLE = 11  # layer 1 (9 tensors), final norm, lm_head
LOST = 9  # layer 1's tensors: its input needs no grad under reentrant checkpointing

# activation_checkpointing_enable (and the choke point both names reach) exists from 5.23 on
HAS_AC = TRANSFORMERS >= Version("5.23")
NO_AC = f"transformers {TRANSFORMERS} has no activation_checkpointing_enable (added in 5.23)"
VARIANTS = [
    pytest.param("gc", "ids", id="gradient_checkpointing_enable-input_ids"),
    pytest.param("gc", "embeds", id="gradient_checkpointing_enable-inputs_embeds"),
    pytest.param("ac", "ids", id="activation_checkpointing_enable-input_ids",
                 marks=pytest.mark.skipif(not HAS_AC, reason=NO_AC)),
    pytest.param("ac", "embeds", id="activation_checkpointing_enable-inputs_embeds",
                 marks=pytest.mark.skipif(not HAS_AC, reason=NO_AC)),
]
RUNS = [Spec(SCRIPT, ("--api", api, "--input", inp))
        for api in (("gc", "ac") if HAS_AC else ("gc",)) for inp in ("ids", "embeds")]


def plain_lost(api: str, inp: str) -> int:
    """Gradients the plain run loses on this transformers version (measured)."""
    if not V5:
        return LOST
    return 0 if inp == "ids" else LOST


@pytest.mark.parametrize("api, inp", VARIANTS)
def test_frozen_layers_get_exact_gradients_under_reentrant(script_runs, api, inp):
    run = script_runs.get(SCRIPT, "--api", api, "--input", inp, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["trainable"] == TRAINABLE
    assert r["wrong"] == 0, r["wrong_names"]
    assert r["grad_none"] == 0
    assert r["loss_equal"]
    assert r["applied_use_reentrant"] is False


@pytest.mark.parametrize("api, inp", VARIANTS)
def test_plain_run_loses_frozen_layer_gradients_where_transformers_does(script_runs, api, inp):
    run = script_runs.get(SCRIPT, "--api", api, "--input", inp, gcpatch=False)
    assert_plain(run)
    r = run.result
    assert r["trainable"] == TRAINABLE
    assert r["applied_use_reentrant"] is True
    assert r["wrong"] == plain_lost(api, inp), r["wrong_names"]
    assert r["grad_none"] == plain_lost(api, inp)
    if r["wrong"]:
        assert all(name.startswith("model.layers.1.") for name in r["wrong_names"])


@pytest.mark.parametrize("api, inp", VARIANTS)
def test_r1_decision_is_logged_recorded_and_explained(script_runs, api, inp):
    run = script_runs.get(SCRIPT, "--api", api, "--input", inp, gcpatch=True)
    records = enable_records(run)
    assert len(records) == 1, records
    rec = records[0]
    assert rec["source"] == "call"
    # X1: on 5.x both public names reach the wrapped choke point; the record names the one called
    assert rec["api"] == ("activation_checkpointing_enable" if api == "ac" else "gradient_checkpointing_enable")
    assert rec["asked"]["use_reentrant"] is True
    # 5.x: both names reach _activation_checkpointing_enable, which is what gcpatch wraps (X1)
    assert ("activation_checkpointing_kwargs" if api == "ac" else "gradient_checkpointing_kwargs") in rec["asked"]["from"]
    assert rec["applied"]["use_reentrant"] is False
    assert "R1" in rec["rules"]
    assert rec["why"]["use_reentrant"].startswith("R1:")
    assert rec["decision"]["winners"]["use_reentrant"]["rule"] == "R1"
    assert any(v["rule"] == "USER" and v["value"] is True for v in rec["decision"]["overruled"])
    assert any("R1" in w for w in rec["decision"]["warnings"])
    assert rec["facts"]["partially_frozen"] is True
    assert rec["applied"]["use_cache_off"] == "use_cache True -> False"  # R6
    assert run.result["use_cache"] is False
    lines = run.gcpatch_lines()
    assert len(lines) == 1 and "use_reentrant True -> False (R1: " in lines[0] and len(lines[0]) <= 120, run.stderr
    assert_explained(run, "R1", "use_reentrant=False")
