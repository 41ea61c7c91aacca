"""Warnings a framework raises inside a call gcpatch wraps name the caller the framework meant:
DDP's deprecated `broadcast_buffers` (stacklevel=2) names the user's line, never gcpatch."""

from __future__ import annotations

from testkit.harness import free_port, result_of, run_python

SCRIPT = """
import os, json, warnings, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
dist.init_process_group("gloo", rank=0, world_size=1)
m = torch.nn.Linear(4, 4)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    DDP(m, broadcast_buffers=False)  # line 9
    checkpoint(m, torch.randn(2, 4, requires_grad=True))  # use_reentrant not passed: torch warns
dist.destroy_process_group()
print("RESULT " + json.dumps([[w.filename, w.lineno, str(w.message)[:40]] for w in caught]))
"""


def _sources(tmp_path, gcpatch):
    caught = result_of(
        run_python(
            SCRIPT,
            tmp_path,
            GCPATCH=gcpatch,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            PYTHONWARNINGS="default",
        )
    )
    return {
        (
            file if file == "<string>" else file.rsplit("/", 2)[-2] + "/" + file.rsplit("/", 1)[-1],
            line,
        )
        for file, line, _ in caught
    }, caught


def test_framework_warnings_name_the_same_source_with_and_without_gcpatch(tmp_path):
    plain, _ = _sources(tmp_path, "0")
    ours, caught = _sources(tmp_path, "1")
    assert ("<string>", 9) in plain  # DDP's FutureWarning names the user's line
    assert ours == plain, caught
    # by the folder the file lies in, not a search of the whole path: a checkout in a folder named
    # gcpatch (git's default) holds the test envs' torch too
    assert not any(
        place.split("/")[0] in ("gcpatch", "gcpatch_plugins")
        or place.endswith("_gcpatch_startup.py")
        for place, _ in ours
    ), caught
