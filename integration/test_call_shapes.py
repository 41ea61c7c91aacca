"""Never worse than plain, never worse than the blunt patch, on call shapes a framework's default or
the blunt patch gets wrong (integration/scripts/call_shapes.py), each run three ways: plain
(GCPATCH=0), the blunt force-non-reentrant patch, and GCPATCH=1.

- A layer whose recompute saves other tensors than its forward (a cache built on the first call):
  non-reentrant refuses it (CheckpointError), reentrant runs it exactly. transformers 4.x's own
  default (reentrant) works and is kept (X5, DEFAULT), in a loop and under the Trainer; on 5.x the
  framework's non-reentrant default raises plainly and under gcpatch alike, and gcpatch's note on
  the error names the choice that is exact.
- `checkpoint(block, x, use_reentrant=True)` with x needing no grad: reentrant kept, made exact by an
  input that requires grad (CK1), where non-reentrant would crash on that block.
- Hidden states and a memory bank inside a list, dict or dataclass argument: reentrant does not look
  inside; non-reentrant (CK1) is exact.
- A block returning a dict or a ModelOutput: reentrant returns its tensors without a graph; the
  result passes through the checkpoint as a tuple (CK7), reentrant kept. (hidden, None): exact as
  it is, left alone.
"""

from __future__ import annotations

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import V5, Spec

SCRIPT = "call_shapes.py"
HF = "hf_recompute_differs,trainer_recompute_differs"
DIRECT = "direct_frozen_input"
CONTAINERS = "list_input,dict_input,dataclass_input"
OUTPUTS = "dict_out,model_output_out,tuple_none_out"
RUNS = [Spec(SCRIPT, ("--cases", cases)) for cases in (HF, DIRECT, CONTAINERS, OUTPUTS)]
RECOMPUTE_ERROR = "CheckpointError: torch.utils.checkpoint: A different number of tensors"


def three_ways(script_runs, cases: str):
    """(plain, blunt, gcpatch) results of one run of `cases`."""
    plain = script_runs.get(SCRIPT, "--cases", cases, gcpatch=False)
    blunt = script_runs.get(SCRIPT, "--cases", cases, gcpatch=False, blunt=True)
    ours = script_runs.get(SCRIPT, "--cases", cases, gcpatch=True)
    assert_plain(plain)
    assert_installed_gcpatch_ran(ours)
    return plain, blunt, ours


def exact(figures: dict) -> bool:
    return figures["error"] is None and figures["wrong"] == 0 and figures["trainable"] > 0


def call_records(run, rule: str) -> list[dict]:
    return [r for r in run.records() if r.get("stage") == "call" and rule in r.get("rules", [])]


def test_a_working_framework_default_is_kept_and_said(script_runs):
    plain, blunt, ours = three_ways(script_runs, HF)
    for case in HF.split(","):
        assert blunt.result[case]["error"].startswith(RECOMPUTE_ERROR), blunt.result[case]
        if V5:  # transformers 5 defaults to non-reentrant: it raises plainly, and with gcpatch
            assert plain.result[case]["error"].startswith(RECOMPUTE_ERROR), plain.result[case]
            assert ours.result[case]["error"] == plain.result[case]["error"], ours.describe()
            assert "exact instead: use_reentrant=True" in ours.result[case]["note"], ours.result
        else:  # 4.x's reentrant default is exact, and gcpatch keeps it
            assert exact(plain.result[case]), plain.result[case]
            assert exact(ours.result[case]), ours.describe()
            assert ours.result[case]["use_reentrant"] is True
    enables = [r for r in ours.records() if r.get("stage") == "enable"]
    assert enables, ours.describe()
    for record in enables:
        won = record["decision"]["winners"]["use_reentrant"]
        assert (won["rule"], won["value"]) == ("DEFAULT", not V5), won
        assert record["facts"]["default_use_reentrant"] is (not V5)
    default = f"use_reentrant={not V5}, transformers "
    assert any(
        default in line and "'s default (no rule applies)" in line for line in ours.gcpatch_lines()
    ), ours.stderr


def test_a_frozen_input_keeps_the_callers_reentrant_and_is_exact(script_runs):
    plain, blunt, ours = three_ways(script_runs, DIRECT)
    assert plain.result[DIRECT]["wrong"] == 4, plain.result  # the blocks' 4 tensors get none
    assert blunt.result[DIRECT]["error"].startswith(RECOMPUTE_ERROR), blunt.result
    assert exact(ours.result[DIRECT]), ours.describe()
    [call] = call_records(ours, "CK1")
    assert call["applied"] == {"grad_input": True}, call  # use_reentrant left as the caller asked
    assert any(
        "an input that requires grad, reentrant kept (CK1" in x for x in ours.gcpatch_lines()
    )


@pytest.mark.parametrize("case", CONTAINERS.split(","))
def test_tensors_inside_container_arguments_get_exact_gradients(script_runs, case):
    plain, blunt, ours = three_ways(script_runs, CONTAINERS)
    assert plain.result[case]["wrong"] == 9, plain.result[case]  # 9 of 11 tensors lose theirs
    assert exact(blunt.result[case]), blunt.result[case]
    assert exact(ours.result[case]), ours.describe()
    calls = call_records(ours, "CK1")
    assert calls and all(r["applied"] == {"use_reentrant": False} for r in calls), calls
    assert all(r["facts"]["container_graph_tensors"] > 0 for r in calls), calls


@pytest.mark.parametrize("case", ["dict_out", "model_output_out"])
def test_a_dict_or_model_output_result_keeps_its_graph_without_verify(script_runs, case):
    plain, blunt, ours = three_ways(script_runs, OUTPUTS)
    assert plain.result[case]["wrong"] == 6, plain.result[case]  # 6 of 8 tensors lose theirs
    assert blunt.result[case]["error"].startswith(RECOMPUTE_ERROR), blunt.result[case]
    assert exact(ours.result[case]), ours.describe()
    calls = call_records(ours, "CK7")
    assert calls and all(r["applied"] == {"tuple_outputs": True} for r in calls), calls
    assert all(r["facts"]["outputs_untracked"] == "rebuildable" for r in calls)


def test_a_tuple_with_none_is_exact_as_it_is_and_left_alone(script_runs):
    plain, blunt, ours = three_ways(script_runs, OUTPUTS)
    assert exact(plain.result["tuple_none_out"]), plain.result
    assert blunt.result["tuple_none_out"]["error"].startswith(RECOMPUTE_ERROR), blunt.result
    assert exact(ours.result["tuple_none_out"]), ours.describe()
