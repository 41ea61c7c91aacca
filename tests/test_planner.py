"""The memory budget's first-forward step (gcpatch/planner.py) on models without transformers:
where a per-layer plan cannot be applied it says why and leaves checkpointing as decided, and a
failure while measuring fails open with one line."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from gcpatch import layer_costs, planner  # noqa: E402
from gcpatch.budget import parse  # noqa: E402


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
    planner.arm(model, parse("0.5"))
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        model(torch.randn(2, 4, requires_grad=True) if x is None else x)
    return [r.getMessage() for r in caplog.records if " budget " in r.getMessage()]


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


def test_the_plan_switches_layers_off_and_leaves_the_rng_where_it_was(caplog):
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
    planner.arm(model, parse("0.5"))
    assert [b.gradient_checkpointing for b in model.blocks] == planned
    model(torch.randn(2, 4, requires_grad=True))
    assert [r for r in caplog.records if " budget " in r.getMessage()] == []
