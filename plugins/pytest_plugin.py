"""gcpatch's pytest plugin (entry point `pytest11`): the `gcpatch_verify` fixture, with which a
test asserts that checkpointing on the user's own model and batch gives the gradients of no
checkpointing and saves activation memory.

    def test_checkpointing(gcpatch_verify):
        model = build_my_model().train()
        model.gradient_checkpointing_enable()
        report = gcpatch_verify(model, {"input_ids": ids, "labels": ids}, min_saved=0.5)

This module lives outside the `gcpatch` package on purpose: pytest loads every pytest11 plugin
at start-up, and importing `gcpatch` switches it on. The fixture checks the set-up the test
built; it does not switch gcpatch on (run the suite with GCPATCH=1 to test gcpatch's choices).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import pytest


def _verify_module() -> Any:
    """gcpatch.verify, imported without activating gcpatch when the process has not asked for it."""
    if "gcpatch" in sys.modules or os.environ.get("GCPATCH") is not None:
        from gcpatch import verify

        return verify
    os.environ["GCPATCH"] = "0"
    try:
        from gcpatch import verify
    finally:
        del os.environ["GCPATCH"]
    return verify


def gcpatch_verify_check(
    model: Any,
    batch: Any,
    *,
    rows: int | None = None,
    min_saved: float = 0.3,
    loss_fn: Callable[[Any], Any] | None = None,
) -> Any:
    """Run `model` on `batch` (a dict of keyword inputs, a tuple of positional ones, or one
    tensor) with its checkpointing as set up and without it, from the same RNG state, and assert
    that every trainable gradient matches, that the forward saves at least `min_saved` of its
    activation bytes, and that each checkpointed block is recomputed once. `rows`: the first
    rows of the batch only (default: all). The model's `.grad`s, hooks and the RNG stream are
    left as they were. Returns the report (`.saved_fraction`, `.max_rel_diff`, `.blocks`, ...)."""
    verify = _verify_module()
    if isinstance(batch, dict):
        args, kwargs = (), batch
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    else:
        args, kwargs = (batch,), {}
    report = verify.check(model, args, kwargs, rows=rows, loss_fn=loss_fn)
    failure = report.failure(min_saved=min_saved)
    if failure:
        raise AssertionError(failure)
    return report


@pytest.fixture
def gcpatch_verify() -> Callable[..., Any]:
    """`gcpatch_verify(model, batch, *, rows=None, min_saved=0.3, loss_fn=None)`: assert that
    checkpointing on this model and batch gives the no-checkpointing gradients and saves memory."""
    return gcpatch_verify_check
