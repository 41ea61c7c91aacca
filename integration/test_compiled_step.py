"""torch.compile sees through gcpatch (integration/scripts/compiled_step.py): a compiled training
step with checkpointing has the gradients of a model that never checkpointed, and gcpatch adds no
graph break and no recompile. Before, gcpatch's wrapper of torch.utils.checkpoint.checkpoint (a
wrapt proxy, a context variable, frame walks) and the enum key of the kwargs it wrote broke the
graph at every checkpointed layer (25 breaks against 4 plainly on transformers 5.23)."""
from __future__ import annotations

import pytest

from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import Spec

SCRIPT = "compiled_step.py"
RUNS = [Spec(SCRIPT)]


@pytest.fixture(scope="module")
def runs(script_runs):
    gc, plain = script_runs.get(SCRIPT, gcpatch=True), script_runs.get(SCRIPT, gcpatch=False)
    assert_installed_gcpatch_ran(gc)
    assert_plain(plain)
    return gc.result, plain.result


@pytest.mark.parametrize("case", ["llama", "reentrant"])
def test_compiled_step_is_exact_and_breaks_no_more_than_plain(runs, case):
    got, plain = runs[0][case], runs[1][case]
    assert got["trainable"] > 0 and got["wrong"] == 0, got
    assert got["graph_breaks"] <= plain["graph_breaks"], (got, plain)
    assert got["recompiles"] == plain["recompiles"] == 0, (got, plain)


def test_a_frozen_embedding_reentrant_call_in_a_compiled_region_trains_every_block(runs):
    """Dynamo's checkpoint recomputes inside the compiled backward whatever use_reentrant says: the
    call runs as made there, and every block gets its gradient (eagerly, CK1 makes it so)."""
    got = runs[0]["reentrant"]
    assert got["wrong"] == 0 and got["trainable"] == 8, got
