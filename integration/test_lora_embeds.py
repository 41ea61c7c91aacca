"""LoRA (get_peft_model, r=4, q_proj/v_proj) on a frozen tiny Llama,
`use_reentrant=True`, fed `inputs_embeds`, checkpointing enabled before or after wrapping.

Plain transformers (4.57 and 5.x): the reentrant checkpoint of a block whose inputs need no grad
leaves the loss without a graph: "element 0 of tensors does not require grad". gcpatch, decided
again when PEFT wraps the model (P4): the user's reentrant is correct once the input-grads hook
makes the first checkpointed input require grad (R2, on the embedding output and on inputs_embeds),
so R1 only recommends non-reentrant: fix and warn mode keep the user's True, say nothing against
it, and every LoRA gradient equals the no-checkpointing run; strict mode installs no hook on its own
and raises naming R2 and the fix.
"""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from _asserts import (
    assert_explain_lists_every_decision,
    assert_installed_gcpatch_ran,
    assert_plain,  # noqa: E402
    enable_records,
    final_enable_record,
    winner,
)
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
    assert r["applied_use_reentrant"] is True  # the user's, exact through R2's hook


@pytest.mark.parametrize("order", ORDER)
def test_plain_lora_inputs_embeds_reentrant_crashes(script_runs, order):
    run = script_runs.get(SCRIPT, "--order", order, gcpatch=False)
    assert_plain(run)
    r = run.result
    assert r["error_stage"] == "training step"
    assert "element 0 of tensors does not require grad" in r["error"], r["error"]
    assert r["applied_use_reentrant"] is True


@pytest.mark.parametrize("order", ORDER)
def test_lora_decision_keeps_the_users_choice_whichever_order(script_runs, order):
    run = script_runs.get(SCRIPT, "--order", order, gcpatch=True)
    records = enable_records(run)
    first, last = records[0], final_enable_record(run)
    assert first["asked"]["use_reentrant"] is True
    if order == "before":
        # the base model is fully trainable when enabled: the user's True stands, with R2's hook ...
        assert (
            first["source"] == "call"
            and winner(first) == "USER"
            and first["applied"]["use_reentrant"] is True
        )
        # ... and wrapping it with PEFT decides again (P4)
        assert "P4" in last["source"], last["source"]
    assert last["asked"]["use_reentrant"] is True
    assert last["applied"]["use_reentrant"] is True and last["applied"]["input_grads_hook"] is True
    assert winner(last) == "USER" and "R2" in last["rules"]
    assert last["facts"]["peft"] is True and last["facts"]["partially_frozen"] is True
    assert any(
        v["rule"] == "R1" and v["strength"] == "recommended" for v in last["decision"]["overruled"]
    )
    assert last["decision"]["warnings"] == []
    assert_explain_lists_every_decision(run)


@pytest.mark.parametrize("order", ORDER)
@pytest.mark.parametrize("mode", ["strict", "warn"])
def test_warn_mode_keeps_a_correct_choice_and_strict_names_the_hook_it_needs(
    script_runs, order, mode
):
    run = script_runs.get(SCRIPT, "--order", order, gcpatch=True, env={"GCPATCH_MODE": mode})
    assert_installed_gcpatch_ran(run)
    r = run.result
    if mode == "strict":
        # the user's True is correct only through R2's hook: strict installs nothing on its own
        # and names the rule and the fix (docs/HOW-IT-WORKS.md, "Strict mode")
        assert (r["error"] or "").startswith("GcpatchError: [R2]"), r
        return
    assert r["error"] is None, r["error"]
    assert r["applied_use_reentrant"] is True
    assert r["wrong"] == 0 and r["grad_none"] == 0 and r["loss_equal"], r[
        "wrong_names"
    ]  # R2's hook
    assert not any(
        " warn mode keeps " in line or "overrules" in line for line in run.stderr.splitlines()
    ), run.stderr
    last = final_enable_record(run)
    assert last["decision"]["mode"] == mode and last["decision"]["warnings"] == []
