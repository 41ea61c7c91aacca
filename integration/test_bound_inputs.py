"""The call's own evidence decides where the enable-time decision cannot see (CK1, CK4, CK5), on
remote-code style models that bind their tensors into the checkpointed function
(integration/scripts/bound_inputs.py), with GCPATCH=1 and no code change, against the plain run and
the blunt force-non-reentrant patch.

- bound: every layer input bound into a partial, reentrant asked at the enable call: plain 14 of 16
  tensors get no gradient; gcpatch 0 with the user's reentrant kept (CK1 passes the bound tensors
  as the checkpoint's inputs), the blunt patch 0 by switching it.
- shared_bias: hidden states by keyword beside a shared bias: plain 10 of 12 wrong; gcpatch 0,
  reentrant kept (CK1).
- mllama_shared: hidden states positional, projected image features by keyword to two
  cross-attention layers: plain crashes ("backward through the graph a second time"); gcpatch
  passes the features positionally (CK5), reentrant kept, exact.
- mllama: the same with one cross-attention layer: exact plainly, and gcpatch keeps it reentrant.
- autograd_grad: torch.autograd.grad after a reentrant ask: torch refuses it plainly; gcpatch takes
  the gradients asked for by one ordinary backward (CK6, known only when they are taken); in warn
  mode torch's error carries gcpatch's note naming the fix.
- prebound: a partial of torch's checkpoint built before an explicit `import gcpatch`: rebound.
"""

from __future__ import annotations

from _asserts import assert_explained, assert_plain
from _run import Spec

SCRIPT = "bound_inputs.py"
ALL = "bound,shared_bias,mllama_shared,autograd_grad"
RUNS = [
    Spec(SCRIPT, ("--cases", ALL)),
    Spec(SCRIPT, ("--cases", "mllama")),
    Spec(SCRIPT, ("--cases", "bound,autograd_grad"), env=(("GCPATCH_MODE", "warn"),)),
    Spec(SCRIPT, ("--cases", "bound"), env=(("GCPATCH_MODE", "strict"),)),
    Spec(SCRIPT, ("--cases", "bound"), env=(("GCPATCH_VERIFY", "1"),)),
    Spec(SCRIPT, ("--cases", "prebound", "--import-gcpatch"), env=(("GCPATCH", "unset"),)),
]


def _get(script_runs, cases, gcpatch=True, **kw):
    return script_runs.get(SCRIPT, "--cases", cases, gcpatch=gcpatch, **kw)


def _call_records(run):
    return [r for r in run.records() if r.get("stage") == "call"]


def test_bound_inputs_get_exact_gradients_where_plain_loses_or_crashes(script_runs):
    plain = _get(script_runs, ALL, gcpatch=False)
    assert_plain(plain)
    assert (plain.result["bound"]["wrong"], plain.result["bound"]["trainable"]) == (14, 16)
    assert (plain.result["shared_bias"]["wrong"], plain.result["shared_bias"]["trainable"]) == (
        10,
        12,
    )
    assert plain.result["mllama_shared"]["error"].startswith(
        "RuntimeError: Trying to backward through the graph"
    )
    blunt = _get(script_runs, ALL, gcpatch=False, blunt=True)
    run = _get(script_runs, ALL)
    for case in ("bound", "shared_bias", "mllama_shared"):
        assert blunt.result[case]["wrong"] == 0, blunt.result
        assert run.result[case]["error"] is None and run.result[case]["wrong"] == 0, run.describe()


def test_evidence_at_the_call_keeps_the_enable_time_ask_and_makes_it_exact(script_runs):
    run = _get(script_runs, ALL)
    enables = [r for r in run.records() if r.get("stage") == "enable"]
    assert enables and all(
        r["applied"]["use_reentrant"] is True for r in enables
    )  # the enable kept the ask
    calls = _call_records(run)
    ck1 = [r for r in calls if r["rules"] == ["CK1"]]
    # once per site; the user's reentrant stands, the bound tensors become the checkpoint's inputs
    assert len(ck1) == 2 and all(r["applied"] == {"lift_bound_tensors": True} for r in ck1), calls
    assert all(r["facts"]["enable_decision"] == "USER" for r in ck1)
    assert all(r["decision"]["values"].get("use_reentrant") is True for r in ck1)
    assert not any(r["decision"]["warnings"] for r in ck1)  # nothing of the user's overruled
    [ck5] = [r for r in calls if r["rules"] == ["CK5"]]
    assert (
        ck5["applied"] == {"lift_bound_tensors": True} and ck5["facts"]["bound_graph_tensors"] == 1
    )
    lines = run.gcpatch_lines()
    assert any("bound tensors passed as inputs (CK1: " in line for line in lines), run.stderr
    assert any("bound tensors passed as inputs (CK5" in line for line in lines), run.stderr
    assert "overrules" not in run.stderr, run.stderr
    assert_explained(run, "CK1", "CK5", "lift_bound_tensors")


def test_keyword_features_beside_a_positional_input_are_not_flipped(script_runs):
    plain = _get(script_runs, "mllama", gcpatch=False)
    run = _get(script_runs, "mllama")
    assert plain.result["mllama"]["wrong"] == 0 and run.result["mllama"]["wrong"] == 0
    [enable] = [r for r in run.records() if r.get("stage") == "enable"]
    assert enable["applied"]["use_reentrant"] is True
    # use_reentrant stays as asked at the call too; CK5 only hands the features over positionally (it cannot
    # see at the call whether a later layer shares them, which is where reentrant crashes)
    [call] = _call_records(run)
    assert (
        call["applied"] == {"lift_bound_tensors": True} and "use_reentrant" not in call["applied"]
    ), call


def test_warn_mode_applies_what_keeps_the_users_choice_and_strict_names_it(script_runs):
    """Passing the bound tensors as inputs changes nothing the user chose: warn mode applies it as
    fix mode does; strict changes no call on its own, and names the rule and the fix."""
    warn = _get(script_runs, "bound,autograd_grad", env={"GCPATCH_MODE": "warn"})
    assert warn.result["bound"]["wrong"] == 0, warn.describe()
    assert "warn mode keeps" not in warn.stderr, warn.stderr
    strict = _get(script_runs, "bound", env={"GCPATCH_MODE": "strict"})
    assert (strict.result["bound"]["error"] or "").startswith("GcpatchError: [CK1]"), strict.result


def test_verify_mode_confirms_the_corrected_call(script_runs):
    run = _get(script_runs, "bound", env={"GCPATCH_VERIFY": "1"})
    assert run.result["bound"]["wrong"] == 0
    [verified] = [r for r in run.records() if r.get("stage") == "verify"]
    assert (
        verified["verify"]["gradients_match"] and "gradients match (16 tensors" in verified["line"]
    ), verified


def test_autograd_grad_after_a_reentrant_ask_gets_exact_gradients_or_a_note_naming_the_fix(
    script_runs,
):
    plain = _get(script_runs, ALL, gcpatch=False)
    refused = (
        "RuntimeError: When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad()"
    )
    assert (
        plain.result["autograd_grad"]["error"].startswith(refused)
        and plain.result["autograd_grad"]["notes"] == []
    )
    run = _get(script_runs, ALL)
    assert (
        run.result["autograd_grad"]["error"] is None and run.result["autograd_grad"]["wrong"] == 0
    ), run.result
    [grads] = [r for r in run.records() if r.get("stage") == "grads"]
    assert grads["rules"] == ["CK6"] and grads["entry"] == "torch.autograd.grad"
    assert any(
        "through reentrant checkpoints" in line and "(CK6" in line for line in run.messages()
    )
    warn = _get(
        script_runs, "bound,autograd_grad", env={"GCPATCH_MODE": "warn"}
    )  # warn mode changes nothing
    assert warn.result["autograd_grad"]["error"].startswith(refused)
    [note] = warn.result["autograd_grad"]["notes"]
    assert note.startswith("gcpatch [reentrant_grad]") and "use_reentrant=False" in note, note
    assert "detach" not in note  # never advice that loses gradients


def test_a_partial_of_checkpoint_built_before_import_gcpatch_is_rebound(script_runs):
    plain = script_runs.get(
        SCRIPT, "--cases", "prebound", "--import-gcpatch", gcpatch=False
    )  # GCPATCH=0: off
    assert plain.result["prebound"]["wrong"] == 8
    run = script_runs.get(
        SCRIPT, "--cases", "prebound", "--import-gcpatch", gcpatch=True, env={"GCPATCH": "unset"}
    )
    assert run.result["prebound"]["wrong"] == 0, run.describe()
    assert [r["rules"] for r in _call_records(run)] == [["CK1"]]
