"""The decision point at the checkpoint call (CK1-CK4): code that calls
`torch.utils.checkpoint.checkpoint` itself and FSDP's own checkpoint wrapper, under GCPATCH=1
with no code change, against the plain run and the blunt force-non-reentrant patch.

Hand-written model, reentrant asked after a frozen embedding: plain 12 of 14 trainable tensors
get no gradient; gcpatch 0, reentrant kept and given an input that requires grad (CK1), the blunt
patch 0 by switching it. Where what the function runs cannot be seen (a block looked up in a
global), CK1 switches to non-reentrant, and warn and strict mode say or refuse that. Selective checkpointing with torch's default:
plain raises ValueError; gcpatch runs it non-reentrant (CK3). A correct reentrant call stays
reentrant under gcpatch (the blunt patch changes it). Nested checkpoints: plain and blunt run the
inner block 3 times a step, gcpatch twice (CK2). FSDP2 + FSDP's reentrant checkpoint_wrapper around
layers transformers also checkpoints: plain 3 runs a layer, gcpatch 2, gradients exact.
torch 2.14's curried and decorator forms (`checkpoint(use_reentrant=True)(block)`), whose calls
torch runs past the patched `checkpoint`: the same 12 of 14 missing plainly, 0 under gcpatch, and
the nested inner call with an option of 2.14's (respect_saved_tensors_hooks) runs inline (CK2)
without that option reaching the function; on an older torch these skip, naming it.
"""

from __future__ import annotations

import pytest
from _asserts import assert_explained, assert_plain
from _run import Spec

SCRIPT = "torch_checkpoint_calls.py"
CASES = (
    "frozen_embedding",
    "frozen_embedding_global",
    "context_fn",
    "context_fn_non_reentrant",
    "correct_reentrant",
    "nested",
    "curried_frozen_embedding",
    "decorated_frozen_embedding",
    "nested_curried",
)
RUNS = (
    [Spec(SCRIPT, ("--case", case)) for case in CASES]
    + [
        Spec(SCRIPT, ("--case", case), env=(("GCPATCH_MODE", m),))
        for m in ("warn", "strict")
        for case in ("frozen_embedding", "frozen_embedding_global")
    ]
    + [Spec("fsdp_nested.py", launcher="torchrun2")]
)


def _run(script_runs, case, gcpatch=True, **kw):
    return script_runs.get(SCRIPT, "--case", case, gcpatch=gcpatch, **kw)


def _call_records(run):
    return [r for r in run.records() if r.get("stage") == "call"]


def test_frozen_embedding_reentrant_call_gets_exact_gradients(script_runs):
    plain = _run(script_runs, "frozen_embedding", gcpatch=False)
    assert_plain(plain)
    assert plain.result["wrong"] == 12 and plain.result["trainable"] == 14
    run = _run(script_runs, "frozen_embedding")
    assert run.result["error"] is None and run.result["wrong"] == 0, run.describe()
    assert run.result["ran_reentrant"] is True  # the caller's reentrant, made exact
    [record] = _call_records(run)  # once per call site, not once per block or step
    assert record["rules"] == ["CK1"] and record["applied"] == {"grad_input": True}
    assert record["site"].endswith("torch_checkpoint_calls.py:" + record["site"].rsplit(":", 1)[1])
    assert_explained(run, "CK1", "torch_checkpoint_calls.py")
    # keeping the caller's choice overrules nothing: warn mode applies it as fix mode does; strict
    # changes no call on its own and names the rule and the fix instead (docs/HOW-IT-WORKS.md)
    kept = _run(script_runs, "frozen_embedding", env={"GCPATCH_MODE": "warn"})
    assert kept.result["error"] is None and kept.result["wrong"] == 0, kept.describe()
    strict = _run(script_runs, "frozen_embedding", env={"GCPATCH_MODE": "strict"})
    assert strict.result["error"].startswith("GcpatchError: [CK1]"), strict.result


def test_what_cannot_be_seen_inside_runs_non_reentrant(script_runs):
    plain = _run(script_runs, "frozen_embedding_global", gcpatch=False)
    assert plain.result["wrong"] == 12, plain.result
    run = _run(script_runs, "frozen_embedding_global")
    assert run.result["wrong"] == 0 and run.result["ran_reentrant"] is False, run.describe()
    [record] = _call_records(run)
    assert record["applied"] == {"use_reentrant": False}
    assert record["facts"]["trainable_inside"] is None


def test_warn_mode_only_says_it_and_strict_mode_raises_at_the_first_call(script_runs):
    warn = _run(script_runs, "frozen_embedding_global", env={"GCPATCH_MODE": "warn"})
    assert warn.result["wrong"] == 12  # the call is left as made
    # one short line on the console, the full warning in the record
    assert any(
        "warn mode keeps use_reentrant=True over CK1" in line for line in warn.stderr.splitlines()
    ), warn.describe()
    assert any(
        "CK1 requires use_reentrant=False" in text
        for r in _call_records(warn)
        for text in r["decision"]["warnings"]
    ), _call_records(warn)
    strict = _run(script_runs, "frozen_embedding_global", env={"GCPATCH_MODE": "strict"})
    assert strict.result["error"].startswith("GcpatchError: [CK1]"), strict.result


def test_selective_checkpointing_with_torch_default_runs_non_reentrant(script_runs):
    plain = _run(script_runs, "context_fn", gcpatch=False)
    assert plain.result["error"].startswith("ValueError: Passing `context_fn`")
    run = _run(script_runs, "context_fn")
    assert (
        run.result["error"] is None
        and run.result["wrong"] == 0
        and run.result["ran_reentrant"] is False
    )
    assert [r["rules"] for r in _call_records(run)] == [["CK3"]]


def test_context_fn_call_asked_non_reentrant_is_never_switched(script_runs):
    run = _run(script_runs, "context_fn_non_reentrant")
    assert (
        run.result["error"] is None
        and run.result["wrong"] == 0
        and run.result["ran_reentrant"] is False
    )
    assert _call_records(run) == []


def test_correct_reentrant_call_is_left_untouched(script_runs):
    run = _run(script_runs, "correct_reentrant")
    assert run.result["wrong"] == 0 and run.result["ran_reentrant"] is True
    assert _call_records(run) == [] and run.gcpatch_lines() == []
    blunt = _run(script_runs, "correct_reentrant", gcpatch=False, blunt=True)
    assert blunt.result["ran_reentrant"] is False  # the blunt patch changes a correct call


def test_nested_checkpoint_recomputes_once(script_runs):
    plain = _run(script_runs, "nested", gcpatch=False)
    assert plain.result["inner_runs_per_block"] == 3
    run = _run(script_runs, "nested")
    assert run.result["inner_runs_per_block"] == 2 and run.result["wrong"] == 0
    assert [r["rules"] for r in _call_records(run)] == [["CK2"]]


def _curried(run):
    """The run's result, or a skip where this torch has no curried form."""
    if run.result.get("unsupported"):
        pytest.skip(f"torch {run.result['torch']} has no curried checkpoint (2.14 and later)")
    return run.result


@pytest.mark.parametrize("case", ["curried_frozen_embedding", "decorated_frozen_embedding"])
def test_curried_and_decorated_reentrant_calls_get_exact_gradients(script_runs, case):
    plain = _run(script_runs, case, gcpatch=False)
    assert _curried(plain)["wrong"] == 12 and plain.result["trainable"] == 14, plain.result
    assert_plain(plain)
    run = _run(script_runs, case)
    assert run.result["error"] is None and run.result["wrong"] == 0, run.describe()
    [record] = _call_records(run)
    assert record["rules"] == ["CK1"], record


def test_nested_curried_checkpoint_recomputes_once_without_its_options(script_runs):
    plain = _run(script_runs, "nested_curried", gcpatch=False)
    assert _curried(plain)["inner_runs_per_block"] == 3 and plain.result["error"] is None
    run = _run(script_runs, "nested_curried")
    assert run.result["error"] is None, run.describe()
    assert run.result["inner_runs_per_block"] == 2 and run.result["wrong"] == 0, run.result
    assert [r["rules"] for r in _call_records(run)] == [["CK2"]]


@pytest.mark.distributed
def test_fsdp2_checkpoint_wrapper_around_checkpointed_layers_runs_each_layer_twice(script_runs):
    plain = script_runs.get("fsdp_nested.py", gcpatch=False, launcher="torchrun2")
    assert all(r["max_layer_runs"] == 3 and r["wrong"] == 0 for r in plain.results), (
        plain.describe()
    )
    run = script_runs.get("fsdp_nested.py", gcpatch=True, launcher="torchrun2")
    for result in run.results:
        assert result["error"] is None, result["error"]
        assert (
            result["max_layer_runs"] == 2 and result["wrong"] == 0 and result["trainable"] == 21
        ), result
    ck2 = [r for r in run.records() if r.get("stage") == "call" and r["rules"] == ["CK2"]]
    assert ck2 and all(r["site"].endswith(".py:" + r["site"].rsplit(":", 1)[1]) for r in ck2)
