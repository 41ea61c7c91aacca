"""The memory budget through a job's first steps (gcpatch/step/first_step.py, planner.py, probe.py)
on models without transformers: the first step runs fully checkpointed and is probed from within,
the plan applies from the second; nothing of the user's runs more often than under plain
checkpointing, no process-wide state moves, a layer's side effects stay the user's; where a
per-layer plan cannot be applied it says why; a failure fails open with one line."""

from __future__ import annotations

import functools
import json
import logging
import threading

import pytest

torch = pytest.importorskip("torch")

from torch.utils.checkpoint import checkpoint  # noqa: E402

from gcpatch import headline  # noqa: E402
from gcpatch.budget import parse  # noqa: E402
from gcpatch.step import cost_model, first_step, levers, plan_lines, shapes  # noqa: E402
from gcpatch.step.bytes import Bytes  # noqa: E402
from gcpatch.step.cost_model import CostModel, LayerModel  # noqa: E402
from gcpatch.step.outcome import Outcome  # noqa: E402
from gcpatch.step.solver import solve  # noqa: E402


class Loop(torch.nn.Module):
    """A family older than GradientCheckpointingLayer: the stack's flag, its loop checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = torch.nn.Module()
        self.stack.gradient_checkpointing = True
        self.stack.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for block in self.stack.blocks:
            x = block(x)
        return x


class Layer(torch.nn.Module):
    pass


def _call(self, *args, **kwargs):
    """transformers' GradientCheckpointingLayer.__call__ (4.52-5.22): the layer's call checkpointed
    by its own `_gradient_checkpointing_func` while it trains with its flag on."""
    if self.gradient_checkpointing and self.training:
        call = functools.partial(torch.nn.Module.__call__, self, **kwargs)
        return self._gradient_checkpointing_func(call, *args)
    return torch.nn.Module.__call__(self, *args, **kwargs)


# A class named like transformers' base: facts.is_checkpoint_layer recognises the layout by name.
GradientCheckpointingLayer = type("GradientCheckpointingLayer", (Layer,), {"__call__": _call})


class Block(GradientCheckpointingLayer):
    """A layer whose up-projection holds 4x its output: 2 of 3 reach half the plain bytes."""

    calls = 0

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 8)
        self.gradient_checkpointing = True
        self._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=reentrant)
        self.aux = None

    def forward(self, x):
        Block.calls += 1
        hidden = torch.relu(self.up(x))
        self.aux = hidden.pow(2).mean()  # an auxiliary loss kept on the module (DeepSpeed-MoE)
        return x + self.down(hidden)


class Stack(torch.nn.Module):
    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(reentrant) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _twins(reentrant: bool = False):
    torch.manual_seed(0)
    plain, model = Stack(reentrant), Stack(reentrant)
    model.load_state_dict(plain.state_dict())
    for block in plain.blocks:
        block.gradient_checkpointing = False
    return plain, model


def _step(model, x, aux: str = ""):
    """One training step: the loss, plus the last layer's aux loss kept on the module."""
    loss = model(x).pow(2).sum()
    if aux == "last":
        loss = loss + 100 * model.blocks[-1].aux
    loss.backward()


def _budget_lines(caplog):
    return [headline.unwrap(r.getMessage()) for r in caplog.records if " budget " in r.getMessage()]


@pytest.fixture(autouse=True)
def _fresh():
    yield
    first_step.reset()
    shapes.reset()


def test_a_family_whose_loop_checkpoints_keeps_full_checkpointing_and_says_why(caplog):
    model = Loop()
    first_step.arm(model, parse("0.5"), verifying=False)
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        model(torch.randn(2, 4, requires_grad=True))
    lines = _budget_lines(caplog)
    assert len(lines) == 1, lines
    assert "memory budget 0.5 not applied, every checkpointed layer kept" in lines[0]
    assert "checkpoints its layers from the model's own loop" in lines[0]
    assert model.stack.gradient_checkpointing is True


@pytest.mark.parametrize("reentrant, aux", [(False, ""), (False, "last"), (True, "")])
def test_the_plan_applies_from_the_second_step_exact_and_no_layer_runs_more_often(
    reentrant, aux, caplog
):
    """The first step is the job's own, fully checkpointed: the plan comes at the second training
    forward. Every step's gradients are those of the model that never checkpoints, the aux loss a
    layer keeps on itself included, and each layer runs exactly as often as under plain
    checkpointing (the measuring passes of a budget that re-ran layers outside the step ran them
    5-6 times as often and left a graph-less aux loss on the module). (Under reentrant
    checkpointing the aux loss has no graph whatever the budget: its forward runs without one.)"""
    plain, model = _twins(reentrant)
    _, checkpointed = _twins(reentrant)
    first_step.arm(model, parse("0.5"), verifying=False)
    counts = {}
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        for step in range(3):
            x = torch.randn(4, 8)
            for name, m in (("plain", plain), ("budget", model), ("checkpointed", checkpointed)):
                Block.calls = 0
                _step(m, x, aux)
                counts.setdefault(name, []).append(Block.calls)
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                assert torch.allclose(p.grad, q.grad, atol=1e-6), (step, name)
            for m in (plain, model, checkpointed):
                m.zero_grad()
            if step == 0:
                assert _budget_lines(caplog) == []  # planned at the next training forward
                assert all(b.gradient_checkpointing for b in model.blocks)
    lines = _budget_lines(caplog)
    assert len(lines) == 1 and "2 of 3 layers checkpointed" in lines[0], lines
    assert [b.gradient_checkpointing for b in model.blocks].count(True) == 2
    assert counts["budget"][0] == counts["checkpointed"][0] == 6  # forward and recompute
    assert counts["budget"][1:] == [5, 5] and counts["plain"] == [3, 3, 3]


def test_a_reentrant_step_without_a_backward_is_probed_again_at_the_next():
    """Reentrant checkpointing saves nothing in its forward: its layers are read in their
    recompute. A first training forward whose backward never runs (a skipped batch) leaves the
    probe short, and the next training step is probed instead; no step waits for another."""
    _, model = _twins(reentrant=True)
    first_step.arm(model, parse("0.5"), verifying=False)
    model(torch.randn(4, 8))  # a training forward, its batch then skipped: no backward
    _step(model, torch.randn(4, 8))  # probed again
    assert all(b.gradient_checkpointing for b in model.blocks)
    _step(model, torch.randn(4, 8))
    assert [b.gradient_checkpointing for b in model.blocks].count(True) == 2


def test_a_failure_fails_open_with_one_line(caplog, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no storage here")

    monkeypatch.setattr(cost_model, "build", broken)
    _, model = _twins()
    first_step.arm(model, parse("0.5"), verifying=False)
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        for _ in range(3):
            _step(model, torch.randn(4, 8))
    lines = _budget_lines(caplog)
    assert len(lines) == 1 and "planning failed (RuntimeError: no storage here)" in lines[0], lines
    assert [b.gradient_checkpointing for b in model.blocks] == [True] * 3
    assert all(
        not type(b._gradient_checkpointing_func).__name__.startswith("_") for b in model.blocks
    )  # the probe is off the layers


def test_an_enable_after_the_plan_gets_the_plan_back_at_once(caplog):
    """The Trainer's `train()` enables again after a first run: every layer is switched on by the
    framework, and the plan is put back without probing again."""
    _, model = _twins()
    first_step.arm(model, parse("0.5"), verifying=False)
    for _ in range(2):
        _step(model, torch.randn(4, 8))
    planned = [b.gradient_checkpointing for b in model.blocks]
    for block in model.blocks:
        block.gradient_checkpointing = True  # what the framework's enable does
    caplog.clear()
    first_step.arm(model, parse("0.5"), verifying=False)
    assert [b.gradient_checkpointing for b in model.blocks] == planned
    _step(model, torch.randn(4, 8))
    assert _budget_lines(caplog) == []


def test_the_users_hooks_and_draws_and_another_threads_see_what_they_would_without_gcpatch():
    """The probe is the step's own: no global module hook is taken off, the RNG is not rewound,
    and a second thread's global hook and draws run as they would; the user's own module hooks
    run as often as under plain checkpointing. (torch's checkpoint rewinds the global RNG for a
    recompute where it preserves the RNG state: that is the checkpoint's, here switched off.)"""
    seen, drawn, stop = [], [], threading.Event()
    other = torch.nn.Linear(4, 4)
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, o: seen.append(m) if m is other else None
    )

    def beside():
        while not stop.is_set():
            with torch.no_grad():
                other(torch.randn(1, 4))
            drawn.append(torch.rand(1, dtype=torch.float64).item())

    user = {"budget": [], "checkpointed": []}
    models = {name: _twins()[1] for name in user}  # seeded before the other thread draws
    for model in models.values():
        for block in model.blocks:  # torch's own recompute otherwise rewinds the global RNG
            block._gradient_checkpointing_func = functools.partial(
                checkpoint, use_reentrant=False, preserve_rng_state=False
            )
    batches = [torch.randn(4, 8) for _ in range(2)]
    try:
        thread = threading.Thread(target=beside)
        thread.start()
        for name, model in models.items():
            model.blocks[1].register_forward_hook(lambda m, a, o, n=name: user[n].append(1))
            if name == "budget":
                first_step.arm(model, parse("0.5"), verifying=False)
            for x in batches:
                _step(model, x)
        stop.set()
        thread.join()
    finally:
        handle.remove()
    assert len(seen) == len(drawn)  # every forward of the other thread's model seen
    assert len(set(drawn)) == len(drawn)  # no draw repeated
    assert user["budget"] == user["checkpointed"]


class RaisesOnce(Stack):
    calls = 0

    def forward(self, x):
        RaisesOnce.calls += 1
        if RaisesOnce.calls == 1:
            raise ValueError("first call")
        return super().forward(x)


def test_an_exception_of_the_users_own_forward_surfaces_from_their_call_and_the_probe_goes_on():
    RaisesOnce.calls = 0
    model = RaisesOnce()
    first_step.arm(model, parse("0.5"), verifying=False)
    with pytest.raises(ValueError, match="first call"):
        model(torch.randn(4, 8))
    assert RaisesOnce.calls == 1
    for _ in range(2):
        _step(model, torch.randn(4, 8))
    assert [b.gradient_checkpointing for b in model.blocks].count(True) == 2


def test_a_new_shape_is_planned_from_the_bound_that_holds_more():
    """Attention scores grow with the tokens' square, and so are planned; bytes that may be either
    (two dimensions equal to the token count where a weight has that size too) are planned at a
    new shape from the bound holding more, and a fraction of the user's step without
    checkpointing is taken of the bound holding less: no other shape holds more than its share."""
    layer = LayerModel(
        "Block",
        {"plain": Bytes(100.0, 40.0, 60.0), "whole": Bytes(10.0)},
        {"whole": 1.0},
        {"whole": 1.0},
        1.0,
        Bytes(100.0, 40.0, 60.0),
    )
    costs = CostModel([layer] * 4, Bytes(20.0), (2, 64))
    layers, outside, baseline = costs.at(2, 128)
    assert layers[0].plain == 100 * 2 + 40 * 4 + 60 * 4  # either: squared where it grows
    assert baseline == 20 * 2 + 4 * (100 * 2 + 40 * 4 + 60 * 2)  # either: linear, the lower bound
    layers, _, baseline = costs.at(2, 32)
    assert layers[0].plain == 100 / 2 + 40 / 4 + 60 / 2  # either: linear where it shrinks
    assert baseline == 20 / 2 + 4 * (50 + 10 + 15)


def test_the_users_baseline_leaves_out_layers_only_gcpatchs_input_grads_hook_trains():
    """Frozen bottom layers under reentrant checkpointing hold a graph only because of the
    input-grads hook (R2): the user's own step without checkpointing holds nothing for them, and
    a fraction is of that step."""
    layer = LayerModel(
        "Block", {"plain": Bytes(100.0), "whole": Bytes(10.0)}, {"whole": 1.0}, {}, 1.0, Bytes()
    )
    trained = LayerModel(
        "Block",
        {"plain": Bytes(100.0), "whole": Bytes(10.0)},
        {"whole": 1.0},
        {},
        1.0,
        Bytes(100.0),
    )
    costs = CostModel([layer, layer, trained, trained], Bytes(), (1, 1))
    layers, outside, baseline = costs.at(1, 1)
    plan = solve(layers, outside, parse("0.5").limit(baseline))
    assert baseline == 200 and plan.total <= 100
    assert plan.modes == ["whole"] * 4 and plan.total == 40


def test_the_budgets_first_line_takes_at_most_two_rows_with_every_lever_and_a_refusal():
    """A long model name, three levers, a refused lever and a greedy plan: the line stays within
    two terminal rows, the layer pattern and the shape giving way first; the record keeps every
    detail."""
    modes = ["whole"] * 2 + ["keep-matmuls"] * 3 + ["feed-forward"] * 3
    modes += ["keep-attention"] * 2 + ["plain"] * 2
    plan = solve([], 0.0, 0.0)
    plan.modes, plan.exact, plan.baseline = modes, False, float(100 << 20)
    plan.total, plan.floor, plan.limit = float(49 << 20), float(12 << 20), float(50 << 20)
    plan.recompute_s, plan.full_recompute_s = 0.3, 1.0
    layer = LayerModel(
        "Block",
        {"plain": Bytes(1.0)},
        {},
        {},
        1.0,
        Bytes(1.0),
        {"keep-matmuls": "refused: RuntimeError: " + "x" * 200},
    )
    costs = CostModel([layer] * 12, Bytes(), (4, 4096))
    outcome = Outcome(plan=plan, shape=(4, 4096), costs=costs)
    name = "Qwen2_5_VLForConditionalGeneration"
    line = f"gcpatch: rank 0 budget {name}: {plan_lines.line(parse('0.5'), outcome, name)}"
    rows = headline.wrap(line).splitlines()
    assert len(rows) <= 2, rows
    assert "10 of 12 layers checkpointed" in line and "greedy" in line, line
    assert "refused" in line and "x" * 20 not in line, line
    assert any("x" * 20 in detail for detail in plan_lines.details(outcome))


class Toy(levers.Lever):
    """A lever from outside gcpatch: the layer checkpointed whole by its own function, counted,
    and priced at a tenth of whole's recompute (as a cheaper kernel would be)."""

    name = "toy"
    title = "the toy way"
    says = "run the toy way"
    brief = "toy"

    def offered(self, layer, func, facts, accelerator):
        return None

    def held(self, facts):
        return facts.inputs + Bytes(1.0)

    def counted(self, facts):
        return 0.1

    def wrap(self, func, layer):
        return ToyRun(func)

    def fired(self, wrapped):
        return wrapped.runs > 0

    def own(self, func):
        return func.func if isinstance(func, ToyRun) else None


class ToyRun:
    def __init__(self, func) -> None:
        self.func, self.runs = func, 0

    def __call__(self, *args, **kwargs):
        self.runs += 1
        return self.func(*args, **kwargs)


def test_a_lever_registered_from_outside_is_measured_planned_installed_reported_and_recorded(
    caplog, monkeypatch, tmp_path
):
    """Adding a lever is one file and one registry line: registered from here, it is in the cost
    model, the plan takes it over whole (cheaper, nearly as small), the layers run under it, the
    line names it, and the record keeps its figures."""
    monkeypatch.setenv("GCPATCH_RECORD", str(tmp_path))
    levers.register(Toy())
    try:
        plain, model = _twins()
        first_step.arm(model, parse("0.5"), verifying=False)
        with caplog.at_level(logging.INFO, logger="gcpatch"):
            for _ in range(3):
                x = torch.randn(4, 8)
                _step(model, x)
                _step(plain, x)
                for p, q in zip(model.parameters(), plain.parameters()):
                    assert torch.allclose(p.grad, q.grad, atol=1e-6)
                model.zero_grad()
                plain.zero_grad()
        plans = shapes.of(model)
        assert all("toy" in layer.held for layer in plans.costs.layers)  # measured
        assert plans.last.modes.count("toy") == 2 and "whole" not in plans.last.modes  # planned
        funcs = [b._gradient_checkpointing_func for b in model.blocks]
        assert [isinstance(f, ToyRun) and f.runs == 2 for f in funcs].count(True) == 2  # installed
        lines = _budget_lines(caplog)
        assert len(lines) == 1 and "(2 run the toy way)" in lines[0], lines  # reported
        records = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.open()]
        budget = next(r["budget"] for r in records if r.get("stage") == "budget")
        assert budget["plan"]["levers"] == {"toy": 2}  # recorded
        assert budget["measured"]["layers"][0]["shares"]["toy"] == pytest.approx(0.1, abs=0.05)
    finally:
        levers.unregister("toy")
