"""LoRA (get_peft_model, r=4, q_proj/v_proj) on a frozen tiny Llama,
`use_reentrant=True`, fed `inputs_embeds`, checkpointing enabled before or after wrapping.

Plain transformers (4.57 and 5.23): the reentrant checkpoint of a block whose inputs need no grad
leaves the loss without a graph: "element 0 of tensors does not require grad". gcpatch (fix mode):
R1 (PEFT -> non-reentrant), decided again when PEFT wraps the model (P4), every LoRA gradient equals
the no-checkpointing run. strict mode raises GcpatchError naming R1; warn mode keeps the user's True,
warns once, and R2's input-grads hook still gives the reference gradients.
"""
from __future__ import annotations

import pytest

pytest.importorskip("peft")

from _asserts import (assert_explain_lists_every_decision, assert_installed_gcpatch_ran, assert_plain,  # noqa: E402
                      enable_records, final_enable_record, winner)
from _run import Spec, outside_plugin_range  # noqa: E402

OUT_OF_RANGE = outside_plugin_range("peft")
pytestmark = pytest.mark.skipif(bool(OUT_OF_RANGE), reason=OUT_OF_RANGE)

SCRIPT = "lora_embeds.py"
ORDERS = ("before", "after")
TRAINABLE = 8  # lora_A/lora_B of q_proj and v_proj in 2 layers
STRICT = (("GCPATCH_MODE", "strict"),)
WARN = (("GCPATCH_MODE", "warn"),)
RUNS = [Spec(SCRIPT, ("--order", o), env=env) for o in ORDERS for env in ((), STRICT, WARN)]
ORDER = [pytest.param(o, id=f"enable-{o}-get_peft_model") for o in ORDERS]


@pytest.mark.parametrize("order", ORDER)
def test_lora_inputs_embeds_reentrant_gets_reference_gradients(script_runs, order):
    run = script_runs.get(SCRIPT, "--order", order, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["error"] is None, r["error"]
    assert r["trainable"] == TRAINABLE
    assert r["wrong"] == 0 and r["grad_none"] == 0, r["wrong_names"]
    assert r["loss_equal"]
    assert r["applied_use_reentrant"] is False


@pytest.mark.parametrize("order", ORDER)
def test_plain_lora_inputs_embeds_reentrant_crashes(script_runs, order):
    run = script_runs.get(SCRIPT, "--order", order, gcpatch=False)
    assert_plain(run)
    r = run.result
    assert r["error_stage"] == "training step"
    assert "element 0 of tensors does not require grad" in r["error"], r["error"]
    assert r["applied_use_reentrant"] is True


@pytest.mark.parametrize("order", ORDER)
def test_lora_decision_is_r1_whichever_order(script_runs, order):
    run = script_runs.get(SCRIPT, "--order", order, gcpatch=True)
    records = enable_records(run)
    first, last = records[0], final_enable_record(run)
    assert first["asked"]["use_reentrant"] is True
    if order == "before":
        # the base model is fully trainable when enabled: the user's True stands, with R2's hook ...
        assert first["source"] == "call" and winner(first) == "USER" and first["applied"]["use_reentrant"] is True
        # ... and wrapping it with PEFT decides again (P4)
        assert "P4" in last["source"], last["source"]
    assert last["asked"]["use_reentrant"] is True
    assert last["applied"]["use_reentrant"] is False
    assert winner(last) == "R1" and "R1" in last["rules"]
    assert last["facts"]["peft"] is True and last["facts"]["partially_frozen"] is True
    assert any(v["rule"] == "USER" and v["value"] is True for v in last["decision"]["overruled"])
    assert any("R1" in w for w in last["decision"]["warnings"])
    assert_explain_lists_every_decision(run)


@pytest.mark.parametrize("order", ORDER)
def test_strict_mode_raises_gcpatch_error_naming_r1(script_runs, order):
    run = script_runs.get(SCRIPT, "--order", order, gcpatch=True, env=dict(STRICT))
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["error_type"] == "GcpatchError", r["error"]
    assert r["error_stage"] == "set-up"  # raised by the enable / the wrap, before any training
    assert "[R1]" in r["error"] and "use_reentrant=False" in r["error"], r["error"]


@pytest.mark.parametrize("order", ORDER)
def test_warn_mode_keeps_users_true_warns_once_and_r2_hook_keeps_gradients_right(script_runs, order):
    run = script_runs.get(SCRIPT, "--order", order, gcpatch=True, env=dict(WARN))
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["error"] is None, r["error"]
    assert r["applied_use_reentrant"] is True  # the user's value is kept
    assert r["wrong"] == 0 and r["grad_none"] == 0 and r["loss_equal"], r["wrong_names"]  # R2's hook
    warnings = [line for line in run.stderr.splitlines() if " warn mode keeps " in line]
    assert len(warnings) == 1, run.stderr
    assert warnings[0].startswith("gcpatch: LlamaForCausalLM: warn mode keeps use_reentrant=True over R1 (") and \
        len(warnings[0]) <= 120, warnings[0]
    last = final_enable_record(run)
    assert last["decision"]["mode"] == "warn"
    assert last["applied"]["use_reentrant"] is True and last["applied"]["input_grads_hook"] is True
