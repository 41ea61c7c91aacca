"""A checkpoint function other than torch's (an offloader that replaced
`transformers.modeling_utils.checkpoint`) is a fact of the decision, and where the set-up needs
what it may not honour, the record says what would break and what to do
(scripts/custom_checkpointer.py)."""

from __future__ import annotations

from _asserts import assert_installed_gcpatch_ran, enable_records
from _run import V5, Spec

SCRIPT = "custom_checkpointer.py"
RUNS = [Spec(SCRIPT)]


def test_custom_checkpoint_function_is_a_fact_and_r1_says_what_it_needs(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    rec = enable_records(run)[-1]
    assert rec["facts"]["checkpoint_function"] == "__main__.offload_checkpoint", rec["facts"]
    # the user's reentrant is kept (the input-grads hook serves the stack the embeddings feed); R1's
    # recommendation, recorded as overruled, says what the custom function would break without the hook
    assert rec["decision"]["winners"]["use_reentrant"]["rule"] == "USER"
    [r1] = [v for v in rec["decision"]["overruled"] if v["rule"] == "R1"]
    assert r1["strength"] == "recommended"
    assert (
        "__main__.offload_checkpoint" in r1["reason"]
        and "enable_input_require_grads" in r1["reason"]
    ), r1
    # the function not being torch's, the input-grads hook is in place whatever it runs: the
    # reentrant-only function's layers get exact gradients
    assert run.result["asked_custom"] == ["True"], run.result
    assert rec["applied"].get("input_grads_hook") is True, rec["applied"]
    assert run.result["wrong"] == 0, run.result


def test_plain_custom_checkpoint_function_loses_gradients_on_4x(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=False)
    assert run.result["asked_custom"] == ["True"], run.result
    if (
        not V5
    ):  # 5.x's own input-grads hook covers input_ids models (X2); 4.57's covers adapters only
        assert run.result["wrong"] > 0, run.result
