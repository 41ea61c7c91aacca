"""GCPATCH_MEMORY_BUDGET on two ranks that do not step alike, and under the sharding engines, on
unchanged user scripts (2 gloo CPU ranks under torchrun; the 8-layer tiny Llama of
budget_train.py). Every rank plans for itself from its own first training step, and no rank waits
on another: a rank whose first step differs from the other's (a bad batch both skip, an evaluation
while the other trains, a model of another width) finishes in seconds, within its budget. FSDP2
and DeepSpeed ZeRO-3 are planned as DDP is.

Each script measures by itself what every training forward holds for the backward (under the
engines, less the parameters they gather), counts the layers its backward recomputes, and digests
every gradient it steps with (the full tensors, gathered from the shards). Each run is compared
step by step, tensor by tensor, with the same job without checkpointing (`--checkpointing off`,
run without gcpatch): every training step within its budget (+5%, the plan's tolerance: bytes of
later shapes are extrapolated), every gradient bit for bit. The plans are of whole layers
(GCPATCH_BUDGET_LEVERS=whole): which layers recompute is then what the bytes decide, not a clock,
and each rank's recompute count says that its plan took effect.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import SCRIPT_TIMEOUT_S, Spec

RANKS = "budget_ranks.py"
SHARDED = "budget_sharded.py"
LAUNCH = "torchrun2"
TOLERANCE = 0.05
WHOLE = {"GCPATCH_BUDGET_LEVERS": "whole"}
# Guards, never a verdict: a run of budget_ranks.py takes about 10 s on a loaded 2-core machine, so
# a rank left waiting for another's plan (a hang) fails the run in two minutes rather than five.
# DeepSpeed JIT-builds its shm_comm op at its first init_distributed in an env (about 3 minutes).
SCRIPT_TIMEOUT_S.setdefault(RANKS, 120)
SCRIPT_TIMEOUT_S.setdefault(SHARDED, 600)

# each rank's plan, and a budget refused (gcpatch/step/planner.py's line)
PLAN = re.compile(
    r"gcpatch: rank (?P<rank>\d+) budget .+?: memory budget (?P<budget>\S+): (?P<n>\d+) of"
    r" (?P<m>\d+) layers checkpointed"
)
NOT_APPLIED = re.compile(r"gcpatch: rank \d+ budget .+?: memory budget \S+ not applied")
AGREED = re.compile(
    r"gcpatch: rank (?P<rank>\d+) budget .+?: (?P<rows>\d+) x (?P<tokens>\d+) tokens, the ranks'"
    r" agreed plan .+?: (?P<n>\d+) of (?P<m>\d+) layers checkpointed"
)

# set-up: (the script's arguments, the budget)
SETUPS = {
    # DDP; rank 0's first batch has every label masked (loss NaN), both ranks ran their training
    # forward, agree to skip the step's backward, and train three more
    "skip-after-forward": (("--setup", "skip", "--check", "loss"), "0.5"),
    # the same, rank 0 seeing its bad batch before any forward: only rank 1 ran one
    "skip-before-forward": (("--setup", "skip", "--check", "batch"), "0.5"),
    # DDP; rank 0's first step only evaluates (eval mode, no_grad) while rank 1 trains its first
    # batch under no_sync; then both train
    "evaluate": (("--setup", "evaluate"), "0.5"),
    # each rank its own model, rank 0 at hidden 64, rank 1 at hidden 128: one size, two plans
    "widths": (("--setup", "widths"), "8MB"),
}
SIZES = {"8MB": 8_000_000, "3MB": 3_000_000}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
SHARDED_CASES = [
    pytest.param(
        engine,
        tune,
        budget,
        id=f"{engine}-{tune}-{budget}",
        marks=(
            [
                pytest.mark.zero3,
                pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed"),
            ]
            if engine == "zero3"
            else []
        ),
    )
    for engine in ("fsdp2", "zero3")
    for tune in ("full", "lora")
    for budget in ("0.5", "3MB")
]


def _env(budget: str) -> dict[str, str]:
    return {"GCPATCH_MEMORY_BUDGET": budget, **WHOLE}


def _spec(script: str, args: tuple, budget: str | None) -> Spec:
    if budget is None:  # the reference: the same job without checkpointing, without gcpatch
        return Spec(script, (*args, "--checkpointing", "off"), gcpatch=False, launcher=LAUNCH)
    return Spec(script, args, env=tuple(sorted(_env(budget).items())), launcher=LAUNCH)


def _sharded_args(engine: str, tune: str) -> tuple[str, ...]:
    return ("--engine", engine, "--tune", tune)


# Started ahead in the background (conftest), with their plain runs: what this env's CI runs of this
# file. The ds envs run its ZeRO-3 tests alone (`-m zero3`); the others run the rest, where
# deepspeed is not installed. A run no list names starts when a test asks for it.
RUNS = (
    [_spec(SHARDED, _sharded_args("zero3", tune), None) for tune in ("full", "lora")]
    if HAS_DEEPSPEED
    else [
        *[_spec(RANKS, args, budget) for args, budget in SETUPS.values()],
        *[_spec(RANKS, args, None) for args, _ in SETUPS.values()],
        *[_spec(SHARDED, _sharded_args("fsdp2", tune), None) for tune in ("full", "lora")],
    ]
)


def _get(script_runs, script: str, args: tuple, budget: str | None, gcpatch: bool = True):
    spec = _spec(script, args, budget)
    if not gcpatch:  # the job as set up, checkpointing on, without gcpatch
        spec = spec.plain()
    return script_runs.get(
        spec.script, *spec.args, gcpatch=spec.gcpatch, env=dict(spec.env), launcher=LAUNCH
    )


def _allowed(budget: str, reference_held: int) -> float:
    """The bytes a step may hold: the budget's share of that step's own held bytes without
    checkpointing, or the size."""
    return SIZES[budget] if budget in SIZES else float(budget) * reference_held


def _over_budget(run, reference, budget: str) -> list[tuple]:
    """(rank, step, held, allowed, held / allowed) for every training forward over its budget by
    more than the tolerance."""
    over = []
    for result, ref in zip(run.results, reference.results):
        assert [s["step"] for s in result["steps"]] == [s["step"] for s in ref["steps"]]
        for step, ref_step in zip(result["steps"], ref["steps"]):
            if step.get("held") is None:  # no training forward that step (an evaluation, a skip)
                continue
            allowed = _allowed(budget, ref_step["held"])
            if step["held"] > allowed * (1 + TOLERANCE):
                ratio = round(step["held"] / allowed, 3)
                over.append((result["rank"], step["step"], step["held"], round(allowed), ratio))
    return over


def _wrong_gradients(run, reference) -> list[tuple]:
    """(rank, step, tensors whose gradient differs) for every step that differs from the job's
    without checkpointing, and (rank, 'params_after') where the parameters at the end differ."""
    wrong = []
    for result, ref in zip(run.results, reference.results):
        for step, ref_step in zip(result["steps"], ref["steps"]):
            assert step.get("kind") == ref_step.get("kind"), (step, ref_step)
            if ref_step.get("grads") is None:
                assert step.get("grads") is None
                continue
            differ = sum(a != b for a, b in zip(step["grads"], ref_step["grads"]))
            if differ or len(step["grads"]) != len(ref_step["grads"]):
                wrong.append((result["rank"], step["step"], differ))
        if result["params_after"] != ref["params_after"]:
            wrong.append((result["rank"], "params_after"))
    return wrong


def _plans(run) -> dict[int, list[re.Match]]:
    by_rank: dict[int, list[re.Match]] = {}
    for line in run.messages():
        found = PLAN.match(line)
        if found:
            by_rank.setdefault(int(found["rank"]), []).append(found)
    return by_rank


def _assert_applied_on_every_rank(run, budget: str) -> None:
    """Each rank said its own plan (a share of its layers, not all of them, not 'not applied'), and
    that rank's backward recomputed fewer layers than all at one of its steps."""
    refused = [line for line in run.messages() if NOT_APPLIED.match(line)]
    assert not refused, refused
    plans = _plans(run)
    for result in run.results:
        rank, layers = result["rank"], result["layers"]
        assert plans.get(rank), f"no plan line for rank {rank}:\n{run.stderr[-3000:]}"
        first = plans[rank][0]
        assert first["budget"] == budget and int(first["m"]) == layers, first.group(0)
        assert int(first["n"]) < layers, first.group(0)
        trained = [(s["step"], s["recomputed"]) for s in result["steps"] if "recomputed" in s]
        assert any(recomputed < layers for _, recomputed in trained), (rank, trained)


# ---- DDP and per-rank set-ups ---------------------------------------------------------------

SETUP_IDS = list(SETUPS)


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUP_IDS)
def test_the_set_up_runs_plainly_with_exact_gradients(script_runs, setup):
    """Without gcpatch the job as written (every layer checkpointed) finishes, and steps with the
    gradients of the job without checkpointing: what hangs or differs with gcpatch is gcpatch's."""
    args, budget = SETUPS[setup]
    plain = _get(script_runs, RANKS, args, budget, gcpatch=False)
    assert_plain(plain)
    reference = _get(script_runs, RANKS, args, None)
    assert [r["rank"] for r in plain.results] == [0, 1]
    assert _wrong_gradients(plain, reference) == []
    kinds = [[s.get("kind") for s in r["steps"]] for r in plain.results]
    expected = {
        "skip-after-forward": [["skipped", "train", "train", "train"]] * 2,
        "skip-before-forward": [["skipped", "train", "train", "train"]] * 2,
        "evaluate": [
            ["eval", "train", "train", "train"],
            ["accumulated", "train", "train", "train"],
        ],
        "widths": [["train"] * 3] * 2,
    }[setup]
    assert kinds == expected
    if setup == "skip-before-forward":  # rank 0 ran no forward at its bad batch, rank 1 did
        assert [r["steps"][0].get("held") is None for r in plain.results] == [True, False]
    for result in plain.results:  # every layer recomputed where a backward ran
        assert all(s["recomputed"] == 8 for s in result["steps"] if s.get("grads") is not None)


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUP_IDS)
def test_every_rank_finishes_each_training_step_within_its_budget(script_runs, setup):
    args, budget = SETUPS[setup]
    run = _get(
        script_runs, RANKS, args, budget
    )  # a rank left waiting: no RESULT, the guard fails it
    assert_installed_gcpatch_ran(run)
    assert [r["rank"] for r in run.results] == [0, 1]
    reference = _get(script_runs, RANKS, args, None)
    assert _over_budget(run, reference, budget) == []


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUP_IDS)
def test_every_rank_steps_with_the_gradients_of_the_job_without_checkpointing(script_runs, setup):
    args, budget = SETUPS[setup]
    run = _get(script_runs, RANKS, args, budget)
    reference = _get(script_runs, RANKS, args, None)
    assert _wrong_gradients(run, reference) == []


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUP_IDS)
def test_every_rank_plans_for_itself_and_its_plan_takes_effect(script_runs, setup):
    args, budget = SETUPS[setup]
    run = _get(script_runs, RANKS, args, budget)
    _assert_applied_on_every_rank(run, budget)


# ---- FSDP2 and DeepSpeed ZeRO-3 -------------------------------------------------------------


def _sharded(script_runs, engine: str, tune: str, budget: str):
    args = _sharded_args(engine, tune)
    run = _get(script_runs, SHARDED, args, budget)
    reference = _get(script_runs, SHARDED, args, None)
    assert_installed_gcpatch_ran(run)
    assert [r["rank"] for r in run.results] == [0, 1]
    # the shapes change from step to step and between the ranks, as the script sets them
    shapes = [[(s["rows"], s["tokens"]) for s in r["steps"]] for r in run.results]
    assert shapes == [[(s["rows"], s["tokens"]) for s in r["steps"]] for r in reference.results]
    assert len(set(shapes[0])) > 1 and shapes[0] != shapes[1]
    return run, reference


@pytest.mark.distributed
@pytest.mark.parametrize("engine,tune,budget", SHARDED_CASES)
def test_the_sharded_engines_are_planned(script_runs, engine, tune, budget):
    run, _ = _sharded(script_runs, engine, tune, budget)
    _assert_applied_on_every_rank(run, budget)


@pytest.mark.distributed
@pytest.mark.parametrize("engine,tune,budget", SHARDED_CASES)
def test_every_sharded_step_holds_its_budget(script_runs, engine, tune, budget):
    run, reference = _sharded(script_runs, engine, tune, budget)
    assert _over_budget(run, reference, budget) == []


@pytest.mark.distributed
@pytest.mark.parametrize("engine,tune,budget", SHARDED_CASES)
def test_every_sharded_step_has_the_full_gradients_of_the_job_without_checkpointing(
    script_runs, engine, tune, budget
):
    """The full gradient of every trainable tensor (gathered from the shards), each step, and the
    full parameters after the last step: bit for bit the same engine's without checkpointing."""
    run, reference = _sharded(script_runs, engine, tune, budget)
    losses = [[[s["loss"] for s in r["steps"]] for r in x.results] for x in (run, reference)]
    assert _wrong_gradients(run, reference) == [], losses
    assert losses[0] == losses[1]


ZERO3_CASES = [case for case in SHARDED_CASES if case.values[0] == "zero3"]


@pytest.mark.distributed
@pytest.mark.parametrize("engine,tune,budget", ZERO3_CASES)
def test_under_zero3_each_rank_says_the_plan_the_ranks_run(script_runs, engine, tune, budget):
    """ZeRO-3's ranks run one plan per step, the layer-wise strongest of their own (each rank
    plans from its own batch shape): the first plan line gives the layers the next backward
    recomputes, and where the agreed plan is not the rank's own, a line says the agreed one,
    with the layers that step's backward recomputed. Before, each rank said its own plan."""
    run, _ = _sharded(script_runs, engine, tune, budget)
    plans = _plans(run)
    agreed = [found for found in map(AGREED.match, run.messages()) if found]
    for result in run.results:
        rank, steps = result["rank"], [s for s in result["steps"] if s.get("held") is not None]
        assert steps[1]["recomputed"] == int(plans[rank][0]["n"]), (plans[rank][0].group(0), steps)
        for found in (f for f in agreed if int(f["rank"]) == rank):
            shape = (int(found["rows"]), int(found["tokens"]))
            ran = [s["recomputed"] for s in steps[1:] if (s["rows"], s["tokens"]) == shape]
            assert int(found["n"]) in ran, (found.group(0), ran)
