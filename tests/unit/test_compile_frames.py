"""gcpatch marks its checkpoint frames for torch.compile when dynamo loads (checkpoint_call
`_eager_under_dynamo`), inside the host's own import of torch._dynamo: a dynamo without the hook it
uses, or one whose hook fails, leaves the import alone and says so in one line."""

from __future__ import annotations

import functools
import logging
import sys
import types

import pytest

torch = pytest.importorskip("torch")
from gcpatch import patching  # noqa: E402
from gcpatch.call import checkpoint_call  # noqa: E402


def test_each_frame_gcpatch_decides_in_is_handed_to_dynamo(caplog):
    handed = []
    checkpoint_call._eager_under_dynamo(types.SimpleNamespace(skip_code=handed.append))
    assert handed[:2] == list(patching.GUARD_CODES)
    assert handed[-1] is checkpoint_call.run.__code__  # no strategy for its callees: itself alone
    assert not caplog.records
    # every gcpatch frame between a checkpoint call and the user's function, with each rewrite of
    # the call (as made, an input that requires grad, lifted tensors, a result through a tuple)
    seen = set()

    def user_fn(h, as_dict=False):
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__", "").startswith("gcpatch"):
                seen.add(frame.f_code)
            frame = frame.f_back
        return {"h": h * 2} if as_dict else h * 2

    from gcpatch import engine

    engine.start()
    try:
        lin = torch.nn.Linear(2, 2)
        checkpoint_call.reset()
        frozen = torch.ones(2, 2)
        run = checkpoint_call.run
        original = torch.utils.checkpoint.checkpoint
        original = getattr(original, "__wrapped__", original)
        bound = lin(torch.ones(2))  # a tensor with a graph, bound into a partial
        asked = {"use_reentrant": True}
        lifted = functools.partial(lambda x, b: user_fn(lin(x) + b), b=bound)
        run(original, None, (lifted, frozen), asked)  # CK1: the bound tensor lifted
        run(original, None, (lambda x: user_fn(lin(x)), frozen), asked)  # CK1: an input with grad
        grads = torch.ones(2, 2, requires_grad=True)
        run(original, None, (lambda x: user_fn(lin(x), True), grads), asked)  # CK7: a dict back
    finally:
        engine.stop()
        checkpoint_call.reset()
    assert seen and seen <= set(handed), sorted(c.co_name for c in seen - set(handed))


def test_a_fresh_run_frame_skips_every_frame_it_calls():
    """As torch's own checkpoint (`torch._disable_dynamo`): traced as fresh frames, the decision's
    helpers broke the graph once more than plain (a compiled FSDP2 step on transformers 5.2,
    integration/test_compiled_step.py)."""
    from torch._dynamo import eval_frame
    from torch._dynamo.types import FrameAction

    skipped, strategies = [], {}
    checkpoint_call._eager_under_dynamo(
        types.SimpleNamespace(
            skip_code=skipped.append,
            set_code_exec_strategy=lambda code, strategy: strategies.update({code: strategy}),
        )
    )
    [(code, strategy)] = strategies.items()
    assert code is checkpoint_call.run.__code__ and code not in skipped
    assert (strategy.cur_action, strategy.recursive_action) == (FrameAction.SKIP, FrameAction.SKIP)
    assert callable(eval_frame.set_code_exec_strategy)  # the hook this torch gives


def test_a_dynamo_without_skip_code_is_said_in_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        checkpoint_call._eager_under_dynamo(types.SimpleNamespace())
    assert [r.getMessage() for r in caplog.records] == [
        "gcpatch: this torch's dynamo has no skip_code; a checkpoint call in a frame torch.compile gives back "
        "to eager may add a graph break"
    ]


def test_a_failing_skip_code_never_reaches_the_import(caplog):
    def broken(code):
        raise RuntimeError("no such strategy")

    with caplog.at_level(logging.INFO, logger="gcpatch"):
        checkpoint_call._eager_under_dynamo(types.SimpleNamespace(skip_code=broken))
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    assert "RuntimeError: no such strategy" in caplog.records[0].getMessage()


def test_the_wrapper_code_is_the_code_of_every_plain_function_wrapper():
    wrapper = patching._function_wrapper(abs, patching._passthrough)
    assert wrapper.__code__ is patching.FUNCTION_WRAPPER_CODE and wrapper(-2) == 2
