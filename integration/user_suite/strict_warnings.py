"""A user's own test suite that treats every warning as an error (`-W error`, as `filterwarnings =
error` does), run by integration/test_quiet_in_pytest.py plainly and under GCPATCH=1: gcpatch adds
no warning to the session and no ERROR line for an exception the test expects and catches."""

import os
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import _common as c  # noqa: E402


def enable(model, **kwargs):
    # transformers 5 deprecates the old name with a FutureWarning: call the one it recommends
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def test_a_checkpointing_llama_trains():
    model = c.llama().train()
    enable(model, use_reentrant=False)
    ids = c.input_ids()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_an_expected_backward_error_is_caught():
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    loss = checkpoint(layer, x, use_reentrant=False).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as caught:
        loss.backward()
    notes = getattr(caught.value, "__notes__", [])
    print(f"USER-NOTES {len(notes)} {notes[0].splitlines()[0] if notes else ''}")
