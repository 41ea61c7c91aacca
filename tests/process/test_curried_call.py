"""torch 2.14's curried checkpoint under GCPATCH=1, beyond the gradients the integration tests
compare (integration/test_checkpoint_calls.py): a function whose own keywords are named like one
of checkpoint's runs exactly as torch runs it, said once; the decorator on a method binds to its
instance and is decided per call while gcpatch is on, and is torch's own again after
`gcpatch.deactivate()`; and on a torch without the curried form, `checkpoint(use_reentrant=...)`
raises what it raises plainly."""

from __future__ import annotations

import pytest
from testkit.harness import result_of, run_python

torch = pytest.importorskip("torch")

SCRIPT = """
import json, sys, torch
from torch.utils.checkpoint import checkpoint

def scaled(x, debug=1.0):
    return (x * debug).tanh()

x = torch.randn(3, 4, requires_grad=True)
result = {}
try:
    wrapped = checkpoint(use_reentrant=False)(scaled)
except TypeError as exc:
    result["error"] = f"TypeError: {exc}"
else:
    out = [wrapped(x, debug=2.0) for _ in range(2)]
    result["clash_exact"] = all(torch.equal(o, scaled(x, debug=2.0)) for o in out)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        @checkpoint(use_reentrant=True)
        def run(self, h):
            return self.lin(h)

    frozen = torch.nn.Embedding(5, 4).requires_grad_(False)
    block, other = Block(), torch.nn.Parameter(torch.ones(1))  # another path: the loss has a graph
    (block.run(frozen(torch.tensor([[1, 2]]))).sum() + other.sum()).backward()
    result["method_grad"] = block.lin.weight.grad is not None
    if "gcpatch" in sys.modules:  # switched off, the method made while on is torch's own again
        sys.modules["gcpatch"].deactivate()
        block.lin.weight.grad = None
        (block.run(frozen(torch.tensor([[1, 2]]))).sum() + other.sum()).backward()
        result["grad_after_deactivate"] = block.lin.weight.grad is not None
    result["name"] = Block.run.__name__
print("RESULT " + json.dumps(result))
"""


def test_curried_calls_keep_torch_semantics_and_are_decided(tmp_path):
    plain = result_of(run_python(SCRIPT, tmp_path))
    proc = run_python(SCRIPT, tmp_path, GCPATCH="1")
    ours = result_of(proc)
    curried = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 14)
    if not curried:  # the same TypeError as plainly: gcpatch adds no form torch lacks
        assert plain["error"].startswith("TypeError") and ours == plain, (plain, ours)
        return
    assert plain["clash_exact"] and ours["clash_exact"], (plain, ours)
    assert plain["method_grad"] is False  # reentrant after a frozen embedding: none plainly
    assert ours["method_grad"] is True, proc.stderr
    assert ours["grad_after_deactivate"] is False, ours
    assert ours["name"] == "run" and plain["name"] == "run"
    said = " ".join(proc.stderr.split())  # the console wraps its lines
    assert said.count("scaled is checkpointed through torch's curried checkpoint") == 1, said
    assert "named as checkpoint's own (debug)" in said, said
