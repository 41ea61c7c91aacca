"""GCPATCH_MEMORY_BUDGET=0.5 seen from the user's job: the budget may change which layers recompute
and nothing else the job can see. Unchanged user scripts (nothing in them imports gcpatch) measure
it themselves:

- budget_side_effects.py: MLPs that keep an auxiliary loss on the module (`self.l_aux`, as
  DeepSpeed-MoE's gates do), read back after the forward from the last layer, from layer 0 or from
  a list the MLPs append to; every gradient of four steps against the same model never
  checkpointed, and each MLP's forward calls per step against plain checkpointing;
- budget_threads.py: a second thread's global forward hook and its draws from the global
  generator while the budgeted model trains its first two steps;
- budget_baseline.py: a half-frozen model with `use_reentrant=True`: each step holds at most half
  of what the same job holds with checkpointing never enabled (its own count), on equal batches
  and on batches that grow to 512 and 1024 tokens;
- budget_flops.py: an 8-layer Llama (hidden 256, 2 x 256 tokens): the second step holds at most
  half of the step without checkpointing and recomputes at most 0.35 of full checkpointing's
  matmul FLOPs.

The budget's plan applies from the second training step on (the first runs fully checkpointed);
each budgeted run must say its plan on stderr (`memory budget 0.5: N of M layers checkpointed`,
or the floor's line), so none of these passes on a budget that was never applied.
"""

from __future__ import annotations

import re

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import Spec

BUDGET = {"GCPATCH_MEMORY_BUDGET": "0.5"}
FRACTION = 0.5
TOLERANCE = 0.05
FLOPS_SHARE = 0.35  # of full checkpointing's recomputed matmul FLOPs, at most

SIDE_EFFECTS = "budget_side_effects.py"
WHERE = ("last", "first", "list")
THREADS = "budget_threads.py"
BASELINE = "budget_baseline.py"
FLOPS = "budget_flops.py"
SETUPS = ("frozen", "growing")
RUNS = [
    *(Spec(SIDE_EFFECTS, ("--where", where), env=tuple(BUDGET.items())) for where in WHERE),
    Spec(THREADS, env=tuple(BUDGET.items())),
    *(Spec(BASELINE, ("--setup", setup), env=tuple(BUDGET.items())) for setup in SETUPS),
    Spec(FLOPS, env=tuple(BUDGET.items())),
]

# the budget's line (gcpatch: rank R budget <Model>: ...), whole after unwrapping (Run.messages)
PLAN = re.compile(
    r"gcpatch: rank \d+ budget [\w.-]+: memory budget 0\.5: (?P<n>\d+) of (?P<m>\d+) layers"
    r" checkpointed"
)
FLOOR = re.compile(
    r"gcpatch: rank \d+ budget [\w.-]+: memory budget 0\.5 \(.*is below the floor.*: all"
    r" (?P<m>\d+) layers checkpointed"
)
SKIPPED = re.compile(r"gcpatch: rank \d+ budget [\w.-]+: memory budget 0\.5 not applied")


def _budgeted(script_runs, script: str, *args: str):
    run = script_runs.get(script, *args, gcpatch=True, env=BUDGET)
    assert_installed_gcpatch_ran(run)
    return run


def _plan(run) -> tuple[int, int]:
    """(checkpointed, layers) of the budget's first plan, from its line on stderr."""
    lines = [line for line in run.messages() if " budget " in line and "memory budget 0.5" in line]
    skipped = [line for line in lines if SKIPPED.match(line)]
    assert not skipped, f"the budget was not applied: {skipped}"
    for line in lines:
        if match := PLAN.match(line):
            return int(match["n"]), int(match["m"])
        if match := FLOOR.match(line):
            return int(match["m"]), int(match["m"])
    raise AssertionError(f"no budget line on stderr:\n{run.stderr[-3000:]}")


def _plain(script_runs, script: str, *args: str):
    run = script_runs.get(script, *args, gcpatch=False)
    assert_plain(run)
    return run


# 4.57's reentrant default and its layer call differ from 5.x's: CI runs these there too
@pytest.mark.budget_all_generations
@pytest.mark.parametrize("where", WHERE)
def test_an_aux_loss_kept_on_the_module_gets_the_exact_gradients_on_every_step(script_runs, where):
    run = _budgeted(script_runs, SIDE_EFFECTS, "--where", where)
    result = run.result
    assert result["error"] is None, result["error"]  # e.g. backward through the graph a second time
    assert result["steps_run"] == result["steps_planned"] == 4, result
    _plan(run)
    wrong = [
        f"step {number}: {step['wrong']} of {step['trainable']} gradients wrong"
        f" ({step['grad_none']} missing, max abs diff {step['max_abs_diff']:.3g}; {step['wrong_names']})"
        for number, step in enumerate(result["steps"], start=1)
        if step["wrong"] or step["grad_none"]
    ]
    assert not wrong, "\n".join(wrong)
    # the step's own aux losses, each once: none from a pass outside the step
    assert [s["aux_terms"] for s in result["steps"]] == [
        s["ref_aux_terms"] for s in result["steps"]
    ]


@pytest.mark.parametrize("where", WHERE)
def test_each_mlp_runs_once_or_twice_a_step_never_more_than_under_plain_checkpointing(
    script_runs, where
):
    plain = _plain(script_runs, SIDE_EFFECTS, "--where", where).result
    run = _budgeted(script_runs, SIDE_EFFECTS, "--where", where)
    result = run.result
    # the set-up itself: plain checkpointing runs each MLP twice a step (forward, recompute), exactly
    assert plain["error"] is None and plain["wrong_total"] == 0, plain
    assert [step["calls"] for step in plain["steps"]] == [[2] * plain["layers"]] * 4, plain
    assert result["error"] is None, (result["error"], [s["calls"] for s in result["steps"]])
    calls = [step["calls"] for step in result["steps"]]
    assert len(calls) == 4, calls
    # the first step runs fully checkpointed: each MLP's forward and its recompute, nothing else
    assert calls[0] == plain["steps"][0]["calls"], calls
    checkpointed, layers = _plan(run)
    assert layers == plain["layers"], (checkpointed, layers)
    for step, ref in zip(calls[1:], plain["steps"][1:]):
        assert all(1 <= n <= m for n, m in zip(step, ref["calls"])), (calls, ref["calls"])
        # the layers the plan left plain ran their MLP once
        assert sum(n == 1 for n in step) >= layers - checkpointed, (calls, checkpointed)
    assert result["mlp_calls_total"] <= plain["mlp_calls_total"], (calls, plain["mlp_calls_total"])


def test_another_threads_global_hook_and_random_draws_are_left_alone(script_runs):
    plain = _plain(script_runs, THREADS).result
    run = _budgeted(script_runs, THREADS)
    _plan(run)
    for result in (plain, run.result):  # plain first: the set-up is sound without gcpatch
        assert result["error"] is None and result["other_error"] is None, result
        assert result["steps_run"] == 2 and result["overlapped"] == [True, True], result
        seen = (
            f"GCPATCH={result['env_GCPATCH']}: the hook saw {result['other_hook_calls']} of"
            f" {result['other_forwards']} calls; {result['draws_repeated']} of {result['draws']}"
            f" draws repeated an earlier one, {result['draws_as_fresh_generator']} as a fresh"
            " generator's"
        )
        assert result["other_hook_calls"] == result["other_forwards"] > 0, seen
        assert result["draws_repeated"] == 0, seen
        assert result["draws_as_fresh_generator"] == result["draws"], seen
        # its own backward gave the same gradient every time, and no mode of another thread's ran
        assert result["other_grads_differ"] == result["other_foreign_modes"] == 0, result
    assert run.result["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0), (
        run.result["losses"],
        plain["losses"],
    )


def _within_half_of_the_users_own_step(run) -> None:
    steps = run.result["steps"]
    over = [
        (s["shape"], round(s["held"] / (FRACTION * s["plain_held"]), 3))
        for s in steps[1:]
        if s["held"] > FRACTION * (1 + TOLERANCE) * s["plain_held"]
    ]
    assert not over, f"steps over half of the job's own step without checkpointing: {over}"
    wrong = [
        (s["shape"], s["wrong"], s["grad_none"]) for s in steps if s["wrong"] or s["grad_none"]
    ]
    assert not wrong, f"steps with wrong or missing gradients (shape, wrong, missing): {wrong}"


@pytest.mark.budget_all_generations
def test_a_half_frozen_reentrant_model_holds_half_of_its_own_step_without_checkpointing(
    script_runs,
):
    run = _budgeted(script_runs, BASELINE, "--setup", "frozen")
    _plan(run)
    assert len(run.result["steps"]) == 4
    _within_half_of_the_users_own_step(run)


def test_growing_batches_each_hold_half_of_their_own_step_without_checkpointing(script_runs):
    run = _budgeted(script_runs, BASELINE, "--setup", "growing")
    _plan(run)
    shapes = [step["shape"] for step in run.result["steps"]]
    assert shapes == [[2, 64], [2, 128], [1, 512], [1, 1024]], shapes
    _within_half_of_the_users_own_step(run)


def test_an_8_layer_llama_holds_half_and_recomputes_at_most_a_third_of_full_checkpointing(
    script_runs,
):
    plain = _plain(script_runs, FLOPS).result
    run = _budgeted(script_runs, FLOPS)
    result = run.result
    _plan(run)
    # the same model without checkpointing is counted the same in both runs
    assert result["none"]["backward_flops"] == plain["none"]["backward_flops"], (result, plain)
    assert plain["enabled"]["checkpointed"] == plain["layers"] == 8, plain
    full = plain["enabled"]["backward_flops"] - plain["none"]["backward_flops"]
    assert full > 0, plain
    share = result["recomputed_flops"] / full
    said = (
        f"holds {result['held_fraction']:.3f} of the step without checkpointing, recomputes"
        f" {share:.3f} of full checkpointing's FLOPs ({result['enabled']['checkpointed']} of 8"
        " layers checkpointed)"
    )
    assert result["held_fraction"] <= FRACTION * (1 + TOLERANCE), said
    assert share <= FLOPS_SHARE, said
    assert result["wrong"] == 0 and result["grad_none"] == 0, result
