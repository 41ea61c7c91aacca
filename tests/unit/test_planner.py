"""The memory budget at the first training step (gcpatch/step/first_step.py, gcpatch/step/planner.py)
on models without transformers: the plan is made once the first forward has returned and applies
from the next; where a per-layer plan cannot be applied it says why and leaves checkpointing as
decided; a failure while measuring fails open with one line; the user's own hooks, exceptions and
interrupts see exactly what they would without gcpatch."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from gcpatch import console, headline  # noqa: E402
from gcpatch.budget import parse  # noqa: E402
from gcpatch.step import first_step, layer_costs, planner  # noqa: E402
from gcpatch.step.cost_model import CostModel  # noqa: E402


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


# A class named like transformers' base: facts.is_checkpoint_layer recognises the layout by name.
GradientCheckpointingLayer = type(
    "GradientCheckpointingLayer", (Layer,), {"forward": lambda self, x: x}
)


class Block(GradientCheckpointingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 16)
        self.down = torch.nn.Linear(16, 4)
        self.gradient_checkpointing = True

    def forward(self, x):
        return torch.relu(self.down(torch.relu(self.up(x))))


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _first_forward(model, caplog, x=None):
    first_step.arm(model, parse("0.5"), verifying=False)
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        model(torch.randn(2, 4, requires_grad=True) if x is None else x)
    messages = [headline.unwrap(r.getMessage()) for r in caplog.records]  # a long line is wrapped
    return [m for m in messages if " budget " in m]


@pytest.fixture(autouse=True)
def _fresh():
    yield
    first_step.reset()
    planner.reset()


def test_a_family_whose_loop_checkpoints_keeps_full_checkpointing_and_says_why(caplog):
    model = Loop()
    lines = _first_forward(model, caplog)
    assert len(lines) == 1, lines
    assert "memory budget 0.5 not applied, every checkpointed layer kept" in lines[0]
    assert "checkpoints its layers from the model's own loop" in lines[0]
    assert model.stack.gradient_checkpointing is True


def test_a_measuring_failure_fails_open_with_one_line(caplog, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no storage here")

    monkeypatch.setattr(layer_costs, "measure", broken)
    model = Stack()
    lines = _first_forward(model, caplog)
    assert len(lines) == 1 and "measuring failed (RuntimeError: no storage here)" in lines[0], lines
    assert [b.gradient_checkpointing for b in model.blocks] == [True] * 3
    assert model(torch.randn(2, 4)).shape == (2, 4)  # the job goes on; no second attempt
    assert len([r for r in caplog.records if " budget " in r.getMessage()]) == 1


def test_the_plan_applies_after_the_first_forward_and_leaves_the_rng_where_it_was(caplog):
    model = Stack()
    x = torch.randn(2, 4, requires_grad=True)
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    lines = _first_forward(model, caplog, x)
    assert torch.equal(torch.rand(3), expected)  # the measuring forwards drew from a forked stream
    # a block holds 16 + 4 floats a row plain, its 4 output floats checkpointed: 2 of 3 reach half
    assert len(lines) == 1 and "2 of 3 layers checkpointed" in lines[0], lines
    assert [b.gradient_checkpointing for b in model.blocks].count(True) == 2


def test_an_enable_after_the_plan_gets_the_plan_back_at_once(caplog):
    """The Trainer's `train()` enables again after a first run: every layer is switched on by the
    framework, and the plan (measured once) is put back without measuring again."""
    model = Stack()
    _first_forward(model, caplog)
    planned = [b.gradient_checkpointing for b in model.blocks]
    for block in model.blocks:
        block.gradient_checkpointing = True  # what the framework's enable does
    caplog.clear()
    first_step.arm(model, parse("0.5"), verifying=False)
    assert [b.gradient_checkpointing for b in model.blocks] == planned
    model(torch.randn(2, 4, requires_grad=True))
    assert [r for r in caplog.records if " budget " in r.getMessage()] == []


def _hooked(model, seen):
    """The user's own hooks: a forward pre-hook and hook on the model and on a layer, counting."""
    model.register_forward_pre_hook(lambda m, a: seen.append("model pre"))
    model.register_forward_hook(lambda m, a, o: seen.append("model post"))
    model.blocks[1].register_forward_hook(lambda m, a, o: seen.append("layer post"))


def test_the_users_hooks_run_as_often_as_without_gcpatch(caplog):
    plain_seen, seen = [], []
    plain = Stack()
    _hooked(plain, plain_seen)
    plain(torch.randn(2, 4, requires_grad=True)).sum().backward()
    model = Stack()
    _hooked(model, seen)
    lines = _first_forward(model, caplog)
    assert lines and "layers checkpointed" in lines[0], lines  # the plan was made
    assert seen == plain_seen == ["model pre", "layer post", "model post"]


class RaisesOnce(Stack):
    """A forward that raises on its first call only (a lazily built state that fails once)."""

    calls = 0

    def forward(self, x):
        RaisesOnce.calls += 1
        if RaisesOnce.calls == 1:
            raise ValueError("first call")
        return super().forward(x)


def test_an_exception_of_the_users_own_forward_surfaces_from_their_call(caplog):
    RaisesOnce.calls = 0
    model = RaisesOnce()
    first_step.arm(model, parse("0.5"), verifying=False)
    with pytest.raises(ValueError, match="first call"):
        model(torch.randn(2, 4, requires_grad=True))
    assert RaisesOnce.calls == 1  # nothing of gcpatch's ran the forward before the user's call
    lines = _first_forward(model, caplog)  # the next training forward is the first to return
    assert lines and "layers checkpointed" in lines[0], lines


class AlwaysRaises(Stack):
    calls = 0

    def forward(self, x):
        AlwaysRaises.calls += 1
        raise RuntimeError("broken model")


def test_a_forward_that_always_raises_runs_once_a_call():
    AlwaysRaises.calls = 0
    model = AlwaysRaises()
    first_step.arm(model, parse("0.5"), verifying=False)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="broken model"):
            model(torch.randn(2, 4, requires_grad=True))
    assert AlwaysRaises.calls == 2


def test_an_interrupt_while_measuring_restores_and_plans_at_the_next_forward(caplog, monkeypatch):
    measure = layer_costs.measure
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return measure(*args, **kwargs)

    monkeypatch.setattr(layer_costs, "measure", interrupted)
    model = Stack()
    first_step.arm(model, parse("0.5"), verifying=False)
    torch.manual_seed(4)
    expected = torch.rand(2)
    torch.manual_seed(4)
    with caplog.at_level(logging.INFO, logger="gcpatch"), pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 4, requires_grad=True))
    assert [b.gradient_checkpointing for b in model.blocks] == [True] * 3  # flags restored
    assert any("measuring was interrupted" in r.getMessage() for r in caplog.records)
    x = torch.randn(2, 4, requires_grad=True)
    torch.manual_seed(4)
    lines = _first_forward(model, caplog, x)  # the loop caught it and went on
    assert torch.equal(torch.rand(2), expected)  # measuring drew from a forked stream
    assert len(calls) == 2 and any("layers checkpointed" in line for line in lines), lines


class Scaled(Stack):
    """Buffers the forward's graph saves for its backward, as Gemma's embedding normalizer (a scalar
    the hidden states are multiplied by) and BERT's token_type_ids (indices an embedding looks up),
    and one the forward writes into before it multiplies by it (a step counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.types = torch.nn.Embedding(2, 4)
        self.register_buffer("normalizer", torch.tensor(2.0), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, 8, dtype=torch.long))
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        x = x * self.normalizer + self.types(self.token_type_ids[:, : x.shape[0]]).squeeze(0)
        return super().forward(x * self.steps)


def test_the_first_steps_backward_runs_on_the_buffers_its_forward_saved(caplog):
    """The plan is measured between the first forward and its backward: the measuring forwards
    leave every buffer as that forward saved it, its version counter too, or autograd refuses the
    backward ('modified by an inplace operation'), as it did for Gemma and BERT under a budget."""
    torch.manual_seed(0)
    plain = Scaled()
    model = Scaled()
    model.load_state_dict(plain.state_dict())
    x = torch.randn(2, 4)
    plain(x).pow(2).sum().backward()
    first_step.arm(model, parse("0.5"), verifying=False)
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        out = model(x)
    assert any("layers checkpointed" in r.getMessage() for r in caplog.records)
    out.pow(2).sum().backward()
    assert model.steps.item() == plain.steps.item() == 1  # the measuring forwards' counts undone
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad), name


class Counted(Stack):
    """A buffer the forward writes into and adds (no backward saves it): each pass writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        return super().forward(x + self.steps)


def test_without_torchs_version_setter_the_written_buffer_is_put_back_and_said(caplog, monkeypatch):
    """A torch without the private setter: the contents still come back, and one line says which
    buffers keep a new version (a backward that saved them may then be refused), once: the
    plan's measuring pass and verify's pass would each say it."""
    monkeypatch.delattr(torch._C._autograd, "_unsafe_set_version_counter")
    console.forget()
    model = Counted()
    first_step.arm(model, parse("0.5"), verifying=True)
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
    assert model.steps.item() == 2
    said = [
        r.getMessage()
        for r in caplog.records
        if "keep a new version" in r.getMessage() and r.levelno == logging.WARNING
    ]
    assert len(said) == 1 and said[0].startswith(
        "gcpatch: 1 buffer(s) written by gcpatch's own pass keep a new version (torch has no"
    ), said


class Flattened(Stack):
    """A batch whose first row does not run alone: `media` holds two items a row flattened across
    rows (its first dimension is not the batch's), as a VLM's pixel_values with image_grid_thw."""

    def forward(self, x, media):
        return super().forward(x + media.view(x.shape[0], 2, 4).sum(1))


@pytest.mark.parametrize("rows", [2, 3])
def test_a_batch_whose_first_row_does_not_run_alone_is_measured_whole_at_two_rows(rows, caplog):
    """Two rows are measured whole (no more than the two-row forward holds), proportional to the
    rows; a larger batch is not measured whole, and the line says why no plan was made."""
    model = Flattened()
    x, media = torch.randn(rows, 4, requires_grad=True), torch.randn(2 * rows, 4)
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        outcome = planner.plan(model, model, (x, media), {}, parse("0.5"))
    if rows == 3:
        assert "measuring failed (RuntimeError: shape '[1, 2, 4]'" in outcome["skipped"], outcome
        assert [b.gradient_checkpointing for b in model.blocks] == [True] * 3
        return
    measured = outcome["measured"]
    assert measured["rows"] == [2] and measured["note"].startswith(
        "rows not measured (RuntimeError: shape '[1, 2, 4]'"
    ), measured
    costs = CostModel.from_dict(outcome["cost_model"])
    # proportional: a row holds half of what the two rows held
    assert costs.plain[0](1, 1) == pytest.approx(costs.plain[0](2, 1) / 2)
    assert costs.plain[0](2, 1) == measured["layers"][0]["plain_bytes"] > 0
    assert "2 of 3 layers checkpointed" in headline.unwrap(caplog.records[-1].getMessage())


def test_the_budgets_first_line_takes_at_most_two_rows_with_every_lever_and_a_refusal():
    """A long model name, three levers, a refused lever, a greedy plan and the measuring's cost:
    the line stays within two terminal rows, the layer pattern and the shape giving way first,
    and says the measuring's cost once; the record keeps every detail."""
    from gcpatch.step import solver

    modes = [solver.FULL] * 2 + [solver.KEEP_MATMULS] * 3 + [solver.FEED_FORWARD] * 3
    modes += [solver.KEEP_ATTENTION] * 2 + [solver.PLAIN] * 2
    plan = {
        "plain_bytes": 100 << 20,
        "planned_bytes": 49 << 20,
        "floor_bytes": 12 << 20,
        "limit_bytes": 50 << 20,
        "layers": len(modes),
        "checkpointed": len(modes) - 2,
        "every_n_layers": None,
        "modes": modes,
        "exact": False,
        "below_floor": False,
        "recompute_s": 0.3,
        "full_recompute_s": 1.0,
    }
    refused = {solver.OFFLOAD: {"layers": [0, 1, 2], "why": "RuntimeError: " + "x" * 200}}
    outcome = {
        "plan": plan,
        "shape": [4, 4096],
        "measured": {"seconds": 3.25, "levers": {"refused": refused}, "layers": [{}] * 12},
    }
    name = "Qwen2_5_VLForConditionalGeneration"
    line = f"gcpatch: rank 0 budget {name}: {planner._line(parse('0.5'), outcome, name)}"
    rows = headline.wrap(line).splitlines()
    assert len(rows) <= 2, rows
    assert "10 of 12 layers checkpointed" in line and "greedy" in line, line
    assert line.count("measur") == 1 and "3.2 s" in line, line
    assert "refused" in line and "x" * 20 not in line, line
