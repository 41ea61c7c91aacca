"""The budget's finer lever: a layer checkpointed keeping its matmuls (a selective `context_fn`
that saves the outputs of matmuls and attention kernels and recomputes only the cheap element-wise
ops) holds between a plain layer and a whole checkpointed one. Under GCPATCH_MEMORY_BUDGET=0.5 the
planner chooses per layer among plain, keep-matmuls and whole, from each layer's measured bytes
and the measured cost of a forward that keeps its matmuls (gcpatch/step/selective.py).

The unchanged user script (scripts/budget_selective.py: an 8-layer Llama, 2 x 1024 tokens, sdpa,
attention dropout 0.1) measures by itself what the forward holds, the backward's FLOPs
(torch.utils.flop_counter, which counts matmuls and attention) and every gradient against the run
without checkpointing. Which layers the planner gives which lever depends on the timings it
measures on this machine; what every plan must hold does not: the budget, exact gradients under
dropout, and a layer that keeps its matmuls recomputing none of them."""

from __future__ import annotations

import pytest
from _asserts import assert_installed_gcpatch_ran
from _run import Spec

SCRIPT = "budget_selective.py"
ARGS = ("--dropout", "0.1")
RUNS = [Spec(SCRIPT, ARGS)]
LAYERS = 8
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def selective(script_runs):
    run = script_runs.get(SCRIPT, *ARGS, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    return run


def test_the_plan_holds_the_budget_and_every_gradient_is_exact_under_dropout(selective):
    r = selective.result
    assert r["wrong"] == 0 and r["grad_none"] == 0 and r["trainable"] == 75, r
    assert r["held_fraction"] <= 0.5 * (1 + TOLERANCE), r
    assert r["full_held_fraction"] < 0.1  # the floor is far below the budget: a plan has room
    assert r["modes"] != ["full"] * LAYERS, r["modes"]  # not every layer checkpointed whole


def test_a_layer_that_keeps_its_matmuls_recomputes_none_of_them(selective):
    """The backward's FLOPs beyond the plain run's are the recompute: the whole layers' share of
    full checkpointing's, nothing for a layer that keeps its matmuls (the counter counts matmul
    and attention FLOPs only, the ones it keeps)."""
    r = selective.result
    whole = r["modes"].count("full")
    assert r["recompute_flops_share"] == pytest.approx(whole / LAYERS, abs=0.01), r


def test_the_line_says_how_many_layers_keep_their_matmuls(selective):
    kept = selective.result["modes"].count("selective")
    lines = [m for m in selective.messages() if " budget " in m and "memory budget 0.5" in m]
    assert len(lines) == 1, selective.messages()
    said = f"({kept} keeping their matmuls)" in lines[0]
    assert said == bool(kept), lines[0]
    assert f"{LAYERS - selective.result['modes'].count('plain')} of {LAYERS} layers" in lines[0]
