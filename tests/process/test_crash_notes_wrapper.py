"""Crash notes in a fresh interpreter: a known family gets one note however deep the backward
nests (reentrant checkpointing calls backward inside backward); an unknown error gets none;
the wrapper is installed with the engine and removed with it, by identity."""

from __future__ import annotations

from testkit.harness import result_of, run_python
from testkit.subproc import requires_transformers

pytestmark = requires_transformers


def test_unknown_errors_are_untouched_and_the_wrapper_comes_and_goes(tmp_path):
    code = """
import json, torch, transformers, gcpatch
import torch.utils.checkpoint as cp
armed = getattr(torch.autograd.backward, "_gcpatch_explained", False)  # nothing but the patch points yet
cp.checkpoint(torch.nn.Identity(), torch.ones(1), use_reentrant=False)  # the first call loads the plugins
wrapped = torch.autograd.backward
x = torch.ones(2, requires_grad=True)
try:
    torch.autograd.backward(x * 2, torch.ones(3))  # shape mismatch: not a checkpointing failure
except RuntimeError as exc:
    notes = list(getattr(exc, "__notes__", []))
gcpatch.deactivate()
print("RESULT " + json.dumps({"armed": armed, "wrapped": getattr(wrapped, "_gcpatch_explained", False), "notes": notes,
      "restored": not getattr(torch.autograd.backward, "_gcpatch_explained", False),
      "original_name": torch.autograd.backward.__module__}))
"""
    r = result_of(run_python(code, tmp_path, GCPATCH="1"))
    assert r == {
        "armed": False,
        "wrapped": True,
        "notes": [],
        "restored": True,
        "original_name": "torch.autograd",
    }


def test_not_wrapped_without_gcpatch(tmp_path):
    code = """
import json, torch, transformers
print("RESULT " + json.dumps({"wrapped": getattr(torch.autograd.backward, "_gcpatch_explained", False)}))
"""
    assert result_of(run_python(code, tmp_path, GCPATCH="0"))["wrapped"] is False


def test_one_note_through_nested_reentrant_backward(tmp_path):
    """A second backward through a reentrant-checkpointed function: raised inside the inner
    backward that reentrant checkpointing runs, noted once."""
    code = """
import json, torch, transformers, gcpatch
from torch.utils.checkpoint import checkpoint
w = torch.nn.Parameter(torch.ones(3))
x = torch.ones(3, requires_grad=True)
shared = x * 2  # computed once, outside the step
for step in range(2):
    try:
        checkpoint(lambda t: (t * w).sum(), shared, use_reentrant=True).backward()
    except RuntimeError as exc:
        notes = list(getattr(exc, "__notes__", []))
print("RESULT " + json.dumps({"notes": notes, "records": [e["family"] for e in gcpatch.decisions() if e.get("stage") == "crash"]}))
"""
    r = result_of(run_python(code, tmp_path, GCPATCH="1"))
    assert len(r["notes"]) == 1 and r["notes"][0].startswith("gcpatch [backward_twice]"), r
    assert "no checkpointing decision in this process" in r["notes"][0]
    assert r["records"] == ["backward_twice"]
