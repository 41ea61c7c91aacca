"""gcpatch's module hooks registered with kwargs, taken out by an earlier hook of the same module
call: torch still calls them in that call, without kwargs (torch/nn/modules/module.py reads the
with-kwargs flag as it reaches each hook of the call's snapshot). Under PEFT on transformers 4.57
with GCPATCH_VERIFY, the first-step hook fired R5's decision, which took its one-shot hooks out of
the same runner, and the user's forward died with a TypeError. Each hook must take such a call as
the no-op it is."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gcpatch import apply  # noqa: E402
from gcpatch.budget import parse  # noqa: E402
from gcpatch.step import first_step, shapes  # noqa: E402


def _call_after_taken_out(hook, forward_hook: bool = False):
    """A module whose first pre-hook takes `hook` out before torch reaches it in the same call."""
    module = torch.nn.Linear(2, 2)
    handles = []

    def take_out(mod, args, kwargs):
        for handle in handles:
            handle.remove()

    module.register_forward_pre_hook(take_out, with_kwargs=True)
    if forward_hook:
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    else:
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return module(torch.randn(1, 2))


def test_r5s_one_shot_hook_taken_out_mid_call_does_nothing():
    decided = []
    hook = apply._FirstForward(apply._Armed(torch.nn.Linear(1, 1), decided.append))
    _call_after_taken_out(hook)
    assert decided == []  # it was taken out: R5 decided elsewhere, not here


@pytest.mark.parametrize(
    "hook",
    [
        apply._ModeSync([]),
        apply._inputs_embeds_require_grad,
        shapes.ShapePlans(torch.nn.Linear(1, 1), [], None, parse("0.5"), "model"),
    ],
    ids=["mode-sync", "inputs-embeds", "budget-shapes"],
)
def test_the_other_pre_hooks_taken_out_mid_call_do_nothing(hook):
    out = _call_after_taken_out(hook)
    assert out.shape == (1, 2)


class _Step:
    """What a FirstStep's hooks call on it: a record of each call."""

    def __init__(self) -> None:
        self.calls = []

    def started(self, *args):
        self.calls.append("started")

    def returned(self, *args):
        self.calls.append("returned")


def test_the_first_steps_hooks_taken_out_mid_call_do_nothing():
    step = _Step()
    _call_after_taken_out(first_step._Before(step))
    _call_after_taken_out(first_step._After(step), forward_hook=True)
    assert step.calls == []
