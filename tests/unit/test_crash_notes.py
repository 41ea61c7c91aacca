"""The crash note reads whether one of gcpatch's own passes is running from the flag `context`
owns, which step.invisible sets for each pass: a failure inside a pass is the pass's to say, one
in the user's own backward gets the note."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from gcpatch import context, engine  # noqa: E402
from gcpatch.step import invisible  # noqa: E402


def _backward_without_graph() -> RuntimeError:
    """torch's "element 0 of tensors does not require grad" (the loss_without_grad family)."""
    with pytest.raises(RuntimeError) as raised:
        torch.autograd.backward(torch.ones(2).sum())
    return raised.value


def test_a_crash_gets_its_note_outside_gcpatchs_own_passes_and_none_inside():
    model = torch.nn.Linear(2, 2)
    engine.start()
    try:
        outside = _backward_without_graph()
        with invisible.gcpatch_pass(torch, model):
            flagged = context.in_own_pass()
            inside = _backward_without_graph()
        after = context.in_own_pass()
    finally:
        engine.stop()
    assert [n.split("]")[0] for n in getattr(outside, "__notes__", [])] == [
        "gcpatch [loss_without_grad"
    ]
    assert (flagged, after) == (True, False)
    assert getattr(inside, "__notes__", []) == []


def test_the_flag_counts_nested_passes():
    model = torch.nn.Linear(2, 2)
    with invisible.gcpatch_pass(torch, model):
        with invisible.gcpatch_pass(torch, model):
            pass
        assert context.in_own_pass()
    assert not context.in_own_pass()
