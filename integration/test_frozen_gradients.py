"""Scenario a (R1, R2): a partially frozen Llama (embeddings and layer 0 frozen) checkpointed with
use_reentrant=True.

Plain transformers gives the trainable layer behind the frozen ones no gradient (reentrant
checkpoint of a block whose inputs need no grad): on 4.57 for input_ids and inputs_embeds, on
5.x only for inputs_embeds (5.x hooks the embedding output for input_ids models, X2).
gcpatch keeps the user's reentrant, which is correct once the input-grads hook gives the first
checkpointed input a gradient (R2, on the embedding output and on inputs_embeds): R1 only
recommends non-reentrant here, so fix and warn mode leave the choice and every gradient matches the
reference; strict mode, which installs no hook on its own, raises naming R2 where one is needed. Where no hook can serve, R1 still requires
non-reentrant (test_custom_checkpointer.py, test_families.py's Whisper).
"""

from __future__ import annotations

import pytest
from _asserts import assert_explained, assert_installed_gcpatch_ran, assert_plain, enable_records
from _run import TRANSFORMERS, V5, Spec
from packaging.version import Version

SCRIPT = "frozen_llama.py"
TRAINABLE = 11  # layer 1 (9 tensors), final norm, lm_head
LOST = 9  # layer 1's tensors: its input needs no grad under reentrant checkpointing

# activation_checkpointing_enable (and the choke point both names reach) exists from 5.23 on
HAS_AC = TRANSFORMERS >= Version("5.23")
NO_AC = f"transformers {TRANSFORMERS} has no activation_checkpointing_enable (added in 5.23)"
VARIANTS = [
    pytest.param("gc", "ids", id="gradient_checkpointing_enable-input_ids"),
    pytest.param("gc", "embeds", id="gradient_checkpointing_enable-inputs_embeds"),
    pytest.param(
        "ac",
        "ids",
        id="activation_checkpointing_enable-input_ids",
        marks=pytest.mark.skipif(not HAS_AC, reason=NO_AC),
    ),
    pytest.param(
        "ac",
        "embeds",
        id="activation_checkpointing_enable-inputs_embeds",
        marks=pytest.mark.skipif(not HAS_AC, reason=NO_AC),
    ),
]
RUNS = [
    Spec(SCRIPT, ("--api", api, "--input", inp))
    for api in (("gc", "ac") if HAS_AC else ("gc",))
    for inp in ("ids", "embeds")
] + [
    Spec(SCRIPT, ("--api", "gc", "--input", inp), env=(("GCPATCH_MODE", mode),))
    for inp in ("ids", "embeds")
    for mode in ("warn", "strict")
]


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
    assert (
        r["applied_use_reentrant"] is True
    )  # the user's choice, made exact by the input-grads hook


@pytest.mark.parametrize("inp", ["ids", "embeds"])
@pytest.mark.parametrize("mode", ["warn", "strict"])
def test_warn_mode_keeps_the_correct_choice_and_strict_names_the_hook_it_would_install(
    script_runs, inp, mode
):
    """Warn mode keeps the user's reentrant and installs R2's hook, which changes no choice.
    Strict changes nothing on its own (docs/HOW-IT-WORKS.md, "Strict mode"): where the plain run
    loses gradients the hook would be installed, so it raises naming R2 and the fix; where the
    plain run is exact (5.x on input_ids: transformers' own hook) it runs as fix mode."""
    run = script_runs.get(
        SCRIPT, "--api", "gc", "--input", inp, gcpatch=True, env={"GCPATCH_MODE": mode}
    )
    r = run.result
    if mode == "strict" and plain_lost("gc", inp):
        assert (r.get("error") or "").startswith("GcpatchError: [R2]"), r
        return
    assert r.get("error") is None, r
    assert (r["wrong"], r["grad_none"], r["applied_use_reentrant"]) == (0, 0, True), run.describe()
    [rec] = enable_records(run)
    assert rec["decision"]["warnings"] == [] and "GcpatchError" not in run.stderr


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
def test_kept_choice_is_logged_recorded_and_explained(script_runs, api, inp):
    run = script_runs.get(SCRIPT, "--api", api, "--input", inp, gcpatch=True)
    records = enable_records(run)
    assert len(records) == 1, records
    rec = records[0]
    assert rec["source"] == "call"
    # X1: on 5.x both public names reach the wrapped choke point; the record names the one called
    assert rec["api"] == (
        "activation_checkpointing_enable" if api == "ac" else "gradient_checkpointing_enable"
    )
    assert rec["asked"]["use_reentrant"] is True
    # 5.x: both names reach _activation_checkpointing_enable, which is what gcpatch wraps (X1)
    assert (
        "activation_checkpointing_kwargs" if api == "ac" else "gradient_checkpointing_kwargs"
    ) in rec["asked"]["from"]
    assert rec["applied"]["use_reentrant"] is True and rec["applied"]["input_grads_hook"] is True
    assert rec["rules"][:2] == ["USER", "R2"]
    assert rec["decision"]["winners"]["use_reentrant"]["rule"] == "USER"
    # R1's recommendation is recorded as overruled by the user's correct choice, and nobody is warned
    assert any(
        v["rule"] == "R1" and v["strength"] == "recommended" for v in rec["decision"]["overruled"]
    )
    assert rec["decision"]["warnings"] == []
    assert rec["facts"]["partially_frozen"] is True
    assert [s["fed_by_input_embeddings"] for s in rec["facts"]["stacks"]] == [True]
    if V5:  # transformers' own Llama turns the cache off itself in a training forward: R6 leaves it
        assert "use_cache_off" not in rec["applied"] and "R6" not in rec["rules"]
        assert run.result["use_cache"] is True
    else:  # 4.x's own switch logs in every forward (a graph break under torch.compile)
        assert rec["applied"]["use_cache_off"] == "use_cache True -> False"  # R6
        assert run.result["use_cache"] is False
    lines = run.gcpatch_lines()
    assert lines == [
        "gcpatch: LlamaForCausalLM: use_reentrant=True as asked, exact through the input-grads hook "
        "(R2: frozen upstream)"
    ], run.stderr
    assert_explained(run, "R2", "use_reentrant=True")
