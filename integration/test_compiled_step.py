"""torch.compile sees through gcpatch (integration/scripts/compiled_step.py): a compiled training
step with checkpointing has the gradients of a model that never checkpointed, and gcpatch adds no
graph break and no recompile. Before, gcpatch's wrapper of torch.utils.checkpoint.checkpoint (a
wrapt proxy, a context variable, frame walks) and the enum key of the kwargs it wrote broke the
graph at every checkpointed layer (25 breaks against 4 plainly on transformers 5.23). The same
under FSDP2 (`fully_shard` + compile, 2 gloo ranks: integration/scripts/compiled_fsdp2.py)."""

from __future__ import annotations

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import V5, Spec

SCRIPT = "compiled_step.py"
FSDP2 = "compiled_fsdp2.py"
FIRST_STEP_WORK = (("GCPATCH_MEMORY_BUDGET", "0.5"), ("GCPATCH_VERIFY", "1"))
RUNS = [Spec(SCRIPT), Spec(SCRIPT, env=FIRST_STEP_WORK), Spec(FSDP2, launcher="torchrun2")]


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


def test_a_compiled_fsdp2_step_is_exact_and_breaks_no_more_than_plain(script_runs):
    """FSDP2's own hooks break the graph (dynamo skips their `disable`); gcpatch adds none. Between
    the breaks the checkpoint calls run eagerly: on 4.x, whose default is reentrant, plainly the blocks
    above the frozen embedding get no gradient there (R1); with gcpatch every one is exact. gcpatch's
    own frames run eagerly when dynamo meets them fresh (checkpoint_call._eager_under_dynamo): traced
    into dynamo's checkpoint operator instead, they broke once more per layer on 4.57 (6 against
    plain's 4). On 5.2 a layer's frame given back to eager calls the checkpoint there, and dynamo
    met the point's guard and then the decision's helpers as fresh frames: one break more (5
    against plain's 4). Now a fresh `run` runs eagerly with all it calls, as torch's checkpoint
    does."""
    gc = script_runs.get(FSDP2, gcpatch=True, launcher="torchrun2")
    plain = script_runs.get(FSDP2, gcpatch=False, launcher="torchrun2")
    assert_installed_gcpatch_ran(gc)
    assert_plain(plain)
    assert len(gc.results) == len(plain.results) == 2, gc.describe()
    for got, ref in zip(
        sorted(gc.results, key=lambda r: r["rank"]), sorted(plain.results, key=lambda r: r["rank"])
    ):
        assert got["trainable"] == ref["trainable"] > 0 and got["wrong"] == 0, got
        assert ref["wrong"] == (0 if V5 else ref["trainable"] - 2), (
            ref
        )  # 4.x: all but the head and the norm
        assert got["graph_breaks"] <= ref["graph_breaks"], (
            got["break_reasons"],
            ref["break_reasons"],
        )


def test_a_budget_and_verify_waiting_under_compile_say_so_and_break_nothing(runs, script_runs):
    """The budget's measuring and verify are eager work at the first eager training forward; a job
    whose forwards all run compiled has none. Before, nothing was said: the budget the user set was
    silently never applied. Now one line per model, from dynamo's trace (a constant-result call:
    no graph break), and the compiled step is as without them."""
    run = script_runs.get(SCRIPT, gcpatch=True, env=dict(FIRST_STEP_WORK))
    assert_installed_gcpatch_ran(run)
    plain = runs[1]["llama"]
    got = run.result["llama"]
    assert got["wrong"] == 0 and got["graph_breaks"] <= plain["graph_breaks"], (got, plain)
    assert got["recompiles"] == 0, got
    said = [m for m in run.messages() if "not applied to its compiled forward" in m]
    assert len(said) == 1, run.stderr[-3000:]  # the Llama (the blocks call checkpoint directly)
    assert said[0].startswith("gcpatch: memory budget 0.5 and verify for LlamaForCausalLM "), said
