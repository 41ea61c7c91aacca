"""GCPATCH_MEMORY_BUDGET's arithmetic: what a budget value means (gcpatch/budget.py), and that the
plan is the cheapest one meeting it (gcpatch/step/solver.py), proved against exhaustive search on
small cases."""

from __future__ import annotations

import itertools
import random
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcpatch.budget import parse
from gcpatch.step import plan_lines, solver
from gcpatch.step.outcome import Outcome
from gcpatch.step.solver import LayerCost, solve

BETWEEN = ("keep-attention", "keep-matmuls", "feed-forward")


def cost(
    name,
    plain,
    whole,
    seconds,
    kind="",
    kept=None,
    kept_seconds=0.0,
    attention=None,
    attention_seconds=0.0,
    offloaded=None,
    offloaded_seconds=0.0,
    feed_forward=None,
    feed_forward_seconds=0.0,
    matmuls=(),
):
    """A layer's costs by each mode's bytes and seconds; `matmuls`: (lever, share of whole's
    matmul FLOPs) counted, else each lever's seconds' share of whole's stands in (none for
    keeping the matmuls)."""
    held = {"plain": plain, "whole": whole}
    spent = {"whole": seconds}
    for mode, h, s in (
        ("keep-matmuls", kept, kept_seconds),
        ("keep-attention", attention, attention_seconds),
        ("offload-inputs", offloaded, offloaded_seconds),
        ("feed-forward", feed_forward, feed_forward_seconds),
    ):
        if h is not None:
            held[mode], spent[mode] = h, s
    counted = dict(matmuls)
    for mode in spent:
        if mode not in counted:
            share = spent[mode] / seconds if seconds else 1.0
            counted[mode] = {"whole": 1.0, "offload-inputs": 1.0, "keep-matmuls": 0.0}.get(
                mode, share
            )
        if mode in ("whole", "offload-inputs"):
            counted[mode] = 1.0
    return LayerCost(name, kind, held, spent, counted)


@pytest.mark.parametrize(
    "raw, fraction, nbytes",
    [
        ("0.5", 0.5, None),
        (" 1 ", 1.0, None),
        (".25", 0.25, None),
        ("6GiB", None, 6 * 2**30),
        ("800MB", None, 800 * 10**6),
        ("1.5 gib", None, int(1.5 * 2**30)),
        ("512KiB", None, 512 * 1024),
        ("2e3B", None, 2000),
    ],
)
def test_budget_values_parse_as_a_fraction_or_a_size(raw, fraction, nbytes):
    parsed = parse(raw)
    assert parsed.fraction == fraction and parsed.nbytes == nbytes
    assert parsed.limit(1000.0) == (fraction * 1000.0 if fraction is not None else nbytes)


@pytest.mark.parametrize(
    "raw, reason",
    [
        ("abc", "neither a fraction"),
        ("1.5", "fraction in (0, 1]"),
        ("0", "fraction in (0, 1]"),
        ("6 parsecs", "its unit 'parsecs'"),
        ("0GB", "at least one byte"),
        ("-1", "neither a fraction"),
    ],
)
def test_bad_budget_values_give_the_reason(raw, reason):
    parsed = parse(raw)
    assert isinstance(parsed, str) and reason in parsed, parsed


@pytest.mark.parametrize(
    "raw, capacity",
    [("auto", None), ("AUTO", None), ("auto:24GiB", 24 * 2**30), ("auto: 1e6B", 10**6)],
)
def test_auto_parses_with_or_without_a_stated_capacity(raw, capacity):
    parsed = parse(raw)
    assert parsed.auto and parsed.capacity == capacity and parsed.fraction is None
    assert parsed.limit(1e9, available=1234.0) == 1234.0  # what the device has left, not the plain
    assert parsed.limit(1e9, available=-5.0) == 0.0  # nothing left: the floor (full checkpointing)


@pytest.mark.parametrize(
    "raw, reason",
    [("auto:", "names no capacity"), ("auto:0.5", "not a size"), ("auto:lots", "not a size")],
)
def test_a_bad_auto_capacity_gives_the_reason(raw, reason):
    parsed = parse(raw)
    assert isinstance(parsed, str) and reason in parsed, parsed


def test_a_bad_budget_is_reported_in_one_line_and_not_applied(monkeypatch, capsys):
    from gcpatch import settings as settings_mod

    monkeypatch.setattr(settings_mod, "_reported", set())
    monkeypatch.setenv("GCPATCH_MEMORY_BUDGET", "lots")
    assert settings_mod.read().memory_budget is None
    assert settings_mod.read().memory_budget is None
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "gcpatch: GCPATCH_MEMORY_BUDGET='lots' is not a budget: neither a fraction like 0.5 nor a size"
        " like 6GiB or 800MB; no budget is applied, every layer whose checkpointing is on recomputes"
        " as without the variable"
    ]
    monkeypatch.setenv("GCPATCH_MEMORY_BUDGET", "0.4")
    assert settings_mod.read().memory_budget.fraction == 0.4
    monkeypatch.delenv("GCPATCH_MEMORY_BUDGET")
    assert settings_mod.read().memory_budget is None


def _exhaustive(layers, outside, limit):
    """The least recompute over all 2^n plans holding at most `limit` (ties: fewer bytes held)."""
    best = None
    for flags in itertools.product((False, True), repeat=len(layers)):
        total = outside + sum(l.held("whole") if f else l.plain for l, f in zip(layers, flags))
        if total > limit:
            continue
        cost = sum(l.seconds for l, f in zip(layers, flags) if f)
        if best is None or (cost, total) < best:
            best = (cost, total)
    return best


layer_st = st.builds(
    lambda plain, kept, seconds: cost("l", float(plain), float(min(kept, plain)), seconds / 10),
    st.integers(1, 60),
    st.integers(0, 20),
    st.integers(0, 30),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(layer_st, min_size=1, max_size=9), st.integers(0, 50), st.floats(0.0, 1.1))
def test_the_plan_is_as_cheap_as_exhaustive_search(layers, outside, fraction):
    plain = outside + sum(l.plain for l in layers)
    limit = fraction * plain
    plan = solve(layers, float(outside), limit)
    best = _exhaustive(layers, outside, limit)
    if best is None:  # below the floor: every layer that sheds bytes checkpoints
        assert plan.below_floor
        assert plan.checkpoint == [l.shed > 0 for l in layers]
        assert plan.total == pytest.approx(plan.floor)
        return
    assert not plan.below_floor and plan.exact
    assert plan.total <= limit + 1e-9
    assert plan.recompute_s == pytest.approx(best[0], abs=1e-9)
    total = outside + sum(
        l.held("whole") if f else l.plain for l, f in zip(layers, plan.checkpoint)
    )
    assert total == pytest.approx(plan.total)


def test_identical_layers_checkpoint_evenly_as_every_n_layers_would():
    layers = [cost(str(i), 100.0, 10.0, 1.0, kind="Block") for i in range(8)]
    plan = solve(layers, 0.0, 0.6 * 800)  # shed 320 bytes: 4 layers of 90
    assert plan.checkpoint == [True, False] * 4
    assert plan.count == 4 and plan.every_n_layers() == 2
    assert plan.recompute_s == 4.0 and plan.full_recompute_s == 8.0
    assert solve(layers, 0.0, 800).count == 0  # the whole budget: nothing recomputed
    assert (
        solve(layers, 0.0, 80).checkpoint == [True] * 8
        and solve(layers, 0.0, 80).every_n_layers() == 1
    )


def test_a_budget_below_the_floor_checkpoints_everything_and_names_the_floor():
    layers = [cost(str(i), 100.0, 10.0, 1.0) for i in range(4)]
    plan = solve(layers, 50.0, 60.0)
    assert plan.below_floor and plan.checkpoint == [True] * 4
    assert plan.floor == 90.0 and plan.total == 90.0 and plan.plain_total == 450.0


def test_layers_that_cost_more_checkpointed_are_never_checkpointed():
    layers = [cost("a", 10.0, 30.0, 1.0), cost("b", 100.0, 10.0, 1.0)]
    assert solve(layers, 0.0, 50.0).checkpoint == [False, True]
    assert solve(layers, 0.0, 1.0).checkpoint == [
        False,
        True,
    ]  # the floor, without the layer that adds bytes


def test_the_cheapest_plan_is_not_the_fewest_layers():
    """One big slow layer or two small quick ones: the quick ones recompute less."""
    layers = [
        cost("big", 100.0, 0.0, 5.0),
        cost("s1", 60.0, 0.0, 1.0),
        cost("s2", 60.0, 0.0, 1.0),
    ]
    plan = solve(layers, 0.0, 120.0)  # shed 100
    assert plan.checkpoint == [False, True, True] and plan.recompute_s == 2.0


def test_a_front_too_large_falls_back_to_cheapest_per_byte_and_says_so(monkeypatch):
    monkeypatch.setattr(solver, "MAX_FRONT", 4)
    rng = random.Random(0)
    layers = [cost(str(i), float(rng.randint(50, 500)), 0.0, rng.random()) for i in range(12)]
    plan = solve(layers, 0.0, 0.5 * sum(l.plain for l in layers))
    assert not plan.exact and plan.total <= plan.limit


def _all(layer):
    """Every mode the layer has figures for, useful or not, but a selective lever costing no less
    than a whole recompute (not offered: solver.LayerCost.options): (mode, bytes shed, seconds)."""
    held = {m: layer.held(m) for m in layer.held_by}
    return [
        (m, layer.plain - h, layer.cost(m))
        for m, h in held.items()
        if h is not None and not (m in BETWEEN and layer.cost(m) >= layer.seconds)
    ]


def _exhaustive_choices(layers, outside, limit, bound=None):
    """Over every way to run the layers (plain, keeping matmuls, keeping the attention output, the
    feed-forward block alone, whole, offloaded: each layer's offered options) holding at most
    `limit`: the least recompute, or (with `bound`) the least matmul recompute
    (`LayerCost.redone`: counted FLOPs, else whole and attention-keeping layers' seconds) among
    those costing at most `bound`. (cost, matmul, held) of the best."""
    best = None
    for picks in itertools.product(*(_all(layer) for layer in layers)):
        held = outside + sum(layer.plain - shed for layer, (_, shed, _) in zip(layers, picks))
        cost = sum(seconds for _, _, seconds in picks)
        matmul = sum(layer.redone(mode) for layer, (mode, _, _) in zip(layers, picks))
        if held > limit or (bound is not None and cost > bound):
            continue
        key = (cost, matmul, held) if bound is None else (matmul, cost, held)
        if best is None or key < best[0]:
            best = (key, (cost, matmul, held))
    return None if best is None else best[1]


choice_st = st.builds(
    lambda plain, ckpt, kept, attention, seconds, kept_share, attention_share, offload, split, flops: (
        cost(
            "l",
            float(plain),
            float(min(ckpt, plain)),
            seconds / 10,
            "",
            None if kept is None else float(min(ckpt, plain) + kept),
            seconds / 10 * kept_share,
            None if attention is None else float(min(ckpt, plain) + attention),
            seconds / 10 * attention_share,
            None if offload is None else float(max(0, min(ckpt, plain) - offload[0])),
            seconds / 10 * offload[1] if offload else 0.0,
            feed_forward=None if split is None else float(max(0, plain - split[0])),
            feed_forward_seconds=seconds / 10 * split[1] if split else 0.0,
            matmuls=flops,
        )
    ),
    st.integers(1, 60),
    st.integers(0, 20),
    st.one_of(st.none(), st.integers(0, 40)),
    st.one_of(st.none(), st.integers(0, 15)),
    st.integers(0, 30),
    st.floats(0.0, 1.2),
    st.floats(0.3, 1.2),
    # offloading: the bytes of its inputs it moves off the device, its cost over a whole layer's
    st.one_of(st.none(), st.tuples(st.integers(0, 20), st.floats(1.0, 2.0))),
    # the feed-forward block alone: the bytes it sheds from plain, its cost over a whole layer's
    st.one_of(st.none(), st.tuples(st.integers(0, 60), st.floats(0.0, 1.2))),
    # the levers' counted matmul FLOPs over whole's, or none counted (their seconds stand in)
    st.one_of(
        st.just(()),
        st.tuples(*(st.tuples(st.just(mode), st.floats(0.0, 1.0)) for mode in BETWEEN)),
    ),
)


# like layers repeated (one group each, chosen by counts per mode), or all different
repeated_st = st.lists(st.tuples(choice_st, st.integers(1, 3)), min_size=1, max_size=3).map(
    lambda kinds: [layer for layer, times in kinds for _ in range(times)][:6]
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.lists(choice_st, min_size=1, max_size=6), repeated_st),
    st.integers(0, 50),
    st.floats(0.0, 1.1),
)
def test_the_plan_with_a_finer_lever_is_as_cheap_as_exhaustive_search(layers, outside, fraction):
    """A layer may also be checkpointed keeping its matmuls or its attention output, or run plain
    with its feed-forward block alone checkpointed (fewer bytes shed, less recompute), or whole
    with its inputs offloaded (more bytes shed, the copies'
    time besides): a multiple-choice knapsack, solved exactly; among the plans within SLACK of
    full checkpointing's recompute of the cheapest, the one recomputing the fewest matmuls (their
    counted FLOPs' share of whole's, or where not counted whole, offloaded and attention-keeping
    layers' seconds). Below the floor, each layer's fewest bytes."""
    plain = outside + sum(l.plain for l in layers)
    limit = fraction * plain
    plan = solve(layers, float(outside), limit)
    cheapest = _exhaustive_choices(layers, outside, limit)
    if plan.below_floor:
        assert cheapest is None
        least = [min(l.held(m) for m, *_ in l.options()) for l in layers]
        assert [l.held(m) for l, m in zip(layers, plan.modes)] == least
        return
    assert cheapest is not None and plan.exact
    assert plan.total <= limit + 1e-9
    full_s = sum(l.seconds for l in layers if l.shed > 0)
    selective = any(m in BETWEEN for l in layers for m, *_ in l.options())
    bound = cheapest[0] + (solver.SLACK * full_s if selective else 0)
    assert plan.recompute_s <= bound + 1e-9
    matmul = sum(l.redone(m) for l, m in zip(layers, plan.modes))
    fewest = _exhaustive_choices(layers, outside, limit, bound + 1e-9)
    assert matmul == pytest.approx(fewest[1], abs=1e-9)
    assert plan.every_n_layers() is None or set(plan.modes) <= {"plain", "whole"}


@settings(max_examples=300, deadline=None)
@given(st.lists(choice_st, min_size=1, max_size=6), st.integers(0, 50), st.floats(0.0, 1.1))
def test_past_the_front_limit_the_plan_holds_the_budget_within_one_step_of_the_cheapest(
    layers, outside, fraction
):
    """Many layers each holding other bytes (MoE layers routed differently) outgrow the exact
    search: the greedy over each layer's convex hull of options still holds the budget, takes the
    levers, and costs at most one step up one layer's hull more than the cheapest plan: at most
    that layer's costliest option, which offloading (its copies' time on top of the recompute)
    can make dearer than checkpointing it whole."""
    plain = outside + sum(l.plain for l in layers)
    limit = fraction * plain
    with mock.patch.object(solver, "MAX_FRONT", 0):
        plan = solve(layers, float(outside), limit)
    if plan.below_floor or plan.total <= limit and all(m == "plain" for m in plan.modes):
        return
    cheapest = _exhaustive_choices(layers, outside, limit)
    assert not plan.exact and plan.total <= limit + 1e-9
    step = max(seconds for l in layers for _, _, seconds in l.options())
    assert plan.recompute_s <= cheapest[0] + step + 1e-9


def test_past_the_front_limit_options_in_line_stay_steps_of_their_own():
    """Checkpointing the last layer whole sheds half what offloading it does for half the seconds:
    both lie on one line from plain. Dropped from the hull, the greedy's one step for that layer
    was plain to offloaded, and with the 2-unit layer taken at the same price per byte the plan
    cost 0.5 where checkpointing the last two whole holds the budget for 0.3 (the cheapest: 0.2)."""
    free = cost("l", 1.0, 0.0, 0.0, "")
    layers = [
        free,
        free,
        cost("l", 2.0, 0.0, 0.1, ""),
        cost("l", 8.0, 4.0, 0.2, "", offloaded=0.0, offloaded_seconds=0.4),
    ]
    with mock.patch.object(solver, "MAX_FRONT", 0):
        plan = solve(layers, 0.0, 6.0)
    assert not plan.exact and plan.total <= 6.0
    assert plan.modes == ["whole"] * 4 and plan.recompute_s == pytest.approx(0.3), plan
    assert _exhaustive_choices(layers, 0, 6.0)[0] == pytest.approx(0.2)


def test_plans_within_the_clocks_slack_go_to_the_fewest_whole_layers():
    """8 like layers, half their bytes to shed: 3 whole + 3 keeping + 2 plain cost 3 + 3r layers'
    recompute, 2 whole + 6 keeping 2 + 6r. Where keeping costs up to r = 0.6 of a whole layer the
    second is within SLACK (15%) of full checkpointing's recompute of the first, and recomputes a
    third fewer matmul FLOPs; at r = 0.7 it costs 1.1 layers more, past the slack."""
    for share, whole, kept in ((0.2, 2, 6), (0.5, 2, 6), (0.6, 2, 6), (0.7, 3, 3)):
        layer = cost("l", 1.0, 0.05, 1.0, "block", kept=0.61, kept_seconds=share)
        plan = solve([layer] * 8, 0.0, 4.0)
        assert (plan.modes.count("whole"), plan.counts().get("keep-matmuls", 0)) == (whole, kept), (
            share
        )
        assert plan.total <= 4.0


def test_within_the_slack_the_counted_matmul_flops_break_the_tie_not_the_seconds():
    """8 like layers (a Llama's: 39.5 MiB plain, 2 whole, 18 with the MLP alone checkpointed,
    which recomputes 0.33 of a whole layer's matmul FLOPs), half their bytes to shed. Where a loaded
    clock prices the MLP alone at 0.55 of a whole layer, 1 whole and 6 so is the cheapest by 0.1
    layer and the fewest matmul seconds too: 0.37 of full checkpointing's FLOPs. Its FLOPs counted,
    8 so, within the slack, recompute 0.33."""
    layer = cost("l", 39.5, 2.0, 1.0, "block", feed_forward=18.0, feed_forward_seconds=0.55)
    counted = cost(
        "l",
        39.5,
        2.0,
        1.0,
        "block",
        feed_forward=18.0,
        feed_forward_seconds=0.55,
        matmuls=(("feed-forward", 0.328),),
    )
    limit = 0.5 * (8.5 + 8 * 39.5)

    def flops(plan):
        return sum(counted.redone(mode) for mode in plan.modes) / 8

    by_seconds = solve([layer] * 8, 8.5, limit)
    assert sorted(by_seconds.modes) == ["feed-forward"] * 6 + ["plain", "whole"]
    assert flops(by_seconds) == pytest.approx(0.371)
    by_flops = solve([counted] * 8, 8.5, limit)
    assert by_flops.modes == ["feed-forward"] * 8 and by_flops.total <= limit
    assert flops(by_flops) == pytest.approx(0.328)
    assert by_flops.recompute_s - by_seconds.recompute_s <= solver.SLACK * 8


def test_offloading_is_taken_only_where_whole_layers_cannot_meet_the_budget():
    """8 like layers holding 100 bytes plain, 10 whole (1 s) or 2 offloaded (1.3 s, the copies):
    at 300 bytes whole layers meet it and no layer pays for the copies; at 60, below whole
    checkpointing's floor of 80, the fewest offloaded layers that reach it (3: 3 x 2 + 5 x 10 = 56)
    and the rest whole; at 10, below every option's floor, every layer offloaded."""
    layer = cost("l", 100.0, 10.0, 1.0, "block", offloaded=2.0, offloaded_seconds=1.3)
    roomy = solve([layer] * 8, 0.0, 300.0)
    assert (
        roomy.counts().get("offload-inputs", 0) == 0
        and roomy.count == 6
        and roomy.every_n_layers() is None
    )
    tight = solve([layer] * 8, 0.0, 60.0)
    assert (tight.counts().get("offload-inputs", 0), tight.modes.count("whole")) == (
        3,
        5,
    ) and tight.total == 56.0
    assert not tight.below_floor and tight.every_n_layers() is None
    below = solve([layer] * 8, 0.0, 10.0)
    assert below.below_floor and below.modes == ["offload-inputs"] * 8 and below.floor == 16.0
    assert below.recompute_s == pytest.approx(8 * 1.3)


def test_keeping_matmuls_is_chosen_where_it_sheds_enough_for_less():
    """Half the bytes to shed: two layers kept-matmuls (each sheds 30 of 50 for 1 s) beat one
    layer whole (sheds 45 for 5 s) plus anything."""
    layer = cost("l", 50.0, 5.0, 5.0, "block", kept=20.0, kept_seconds=1.0)
    plan = solve([layer] * 4, 0.0, 140.0)
    assert plan.modes.count("keep-matmuls") == 2 and plan.count == 2
    assert plan.recompute_s == pytest.approx(2.0) and plan.total <= 140.0


def test_keeping_the_attention_output_takes_whole_layers_places_under_a_tight_budget():
    """8 like layers, 100 bytes plain, 2 whole, 60 keeping their matmuls (0.25 of a whole layer's
    recompute), 4 keeping their attention output (0.7): at 240 bytes the plan without the
    attention lever is 5 whole, 2 keeping matmuls and 1 plain (5.5 layers' recompute); with it the
    5 run keeping their attention output instead (4.0)."""
    kwargs = {"kept": 60.0, "kept_seconds": 0.25}
    layer = cost("l", 100.0, 2.0, 1.0, "block", attention=4.0, attention_seconds=0.7, **kwargs)
    plan = solve([layer] * 8, 0.0, 240.0)
    without = solve([cost("l", 100.0, 2.0, 1.0, "block", **kwargs)] * 8, 0.0, 240.0)
    assert plan.total <= 240.0 and without.total <= 240.0
    assert plan.modes.count("whole") == 0 and plan.counts().get("keep-attention", 0) == 5, (
        plan.modes
    )
    assert without.modes.count("whole") == 5, without.modes
    assert plan.recompute_s == pytest.approx(4.0) and without.recompute_s == pytest.approx(5.5)
    assert plan.every_n_layers() is None


def test_past_the_front_limit_layers_still_take_the_levers():
    """12 layers of MoE-like differing sizes, each able to keep its matmuls (0.25 of its
    recompute) or its attention output (0.7): the greedy plan sheds with the levers as the exact
    one does, at most one layer's recompute dearer, where whole layers alone cost far more."""
    rng = random.Random(1)
    layers = []
    for i in range(12):
        f = rng.uniform(0.8, 1.2)
        layers.append(cost(str(i), 100 * f, 2 * f, f, "moe", 60 * f, 0.25 * f, 4 * f, 0.7 * f))
    limit = 0.3 * sum(l.plain for l in layers)
    with mock.patch.object(solver, "MAX_FRONT", 10**6):
        exact = solve(layers, 0.0, limit)
    with mock.patch.object(solver, "MAX_FRONT", 0):
        greedy = solve(layers, 0.0, limit)
    whole = solve([cost(l.name, l.plain, l.held("whole"), l.seconds) for l in layers], 0.0, limit)
    assert exact.exact and not greedy.exact and greedy.total <= limit
    assert (
        greedy.modes.count("whole") == 0
        and greedy.counts().get("keep-attention", 0)
        and greedy.counts().get("keep-matmuls", 0)
    )
    assert greedy.recompute_s <= exact.recompute_s + max(l.seconds for l in layers)
    assert greedy.recompute_s < whole.recompute_s - 2.0


def test_the_line_says_where_the_plan_is_greedy_and_not_where_it_is_exact():
    """Past the exact search's front the plan is within one layer's recompute of the cheapest,
    not proven cheapest: the plan's line says so, and says nothing of it for an exact plan."""
    layers = [cost(f"{i}", 10.0 + i, 1.0, 1.0 + i / 10) for i in range(6)]
    limit = 0.5 * sum(layer.plain for layer in layers)
    chosen = parse("0.5")
    lines = {}
    for front in (0, 10**6):
        with mock.patch.object(solver, "MAX_FRONT", front):
            plan = solve(layers, 0.0, limit)
        lines[plan.exact] = plan_lines.line(chosen, Outcome(plan=plan))
    assert "greedy" in lines[False]  # in full where the two rows have room for it
    assert "greedy" not in lines[True]


def test_a_plan_with_the_ranks_agreed_modes_holds_and_costs_what_those_modes_do():
    """Under ZeRO-3 every rank runs the layer-wise strongest of the ranks' plans
    (gcpatch/step/shapes.py `agreed`): the plan said and recorded is priced for the modes that
    run, not the rank's own. 4 layers of 100 bytes plain, 10 whole (1 s), a 10-byte mask held by
    the checkpoints' calls: this rank's own plan at 320 bytes checkpoints 1 layer
    (3 x 100 + 10 + 10); the agreed one checkpoints 3, holding 3 x 10 + 100 + 10 = 140 bytes for
    3 s."""
    layer = cost("l", 100.0, 10.0, 1.0, "block")
    own = solve([layer] * 4, 0.0, 320.0, calls=10.0)
    assert own.count == 1 and own.total == 320.0
    modes = ["whole", "whole", "whole", "plain"]
    ran = solver.with_modes(own, [layer] * 4, 0.0, 10.0, modes)
    assert ran.modes == modes and ran.count == 3
    assert ran.total == 140.0 and ran.recompute_s == pytest.approx(3.0)
    assert (ran.limit, ran.floor, ran.plain_total) == (own.limit, own.floor, own.plain_total)
    same = solver.with_modes(own, [layer] * 4, 0.0, 10.0, own.modes)
    assert (same.total, same.recompute_s) == (own.total, own.recompute_s)
    plain = solver.with_modes(own, [layer] * 4, 0.0, 10.0, ["plain"] * 4)
    assert plain.total == 400.0  # no layer checkpointed: the calls' mask is not held
