"""Every argument of the user's enable call survives gcpatch's re-call (X1), on every path.

transformers 5.17 added `every_n_layers` and `offload` to `gradient_checkpointing_enable`; 5.17-5.22
have no `_activation_checkpointing_enable`, so gcpatch wraps the public method there, and once
re-called it with `gradient_checkpointing_kwargs` only: all 4 layers checkpointed and the offloading
checkpointer lost, by a direct call and through the Trainer (which passes both since 5.17).
"""

from __future__ import annotations

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import TRANSFORMERS, Spec
from packaging.version import Version

SCRIPT = "enable_arguments.py"
PATHS = ("call", "trainer")
RUNS = [Spec(SCRIPT, ("--path", path)) for path in PATHS]
EVERY_OTHER = [0, 2]  # 4 layers, every_n_layers=2: layer_index % 2 == 0
OFFLOADING = ["checkpoint_func"]  # transformers' save_on_cpu wrapper around torch's checkpoint

OUT_OF_RANGE = (
    ""
    if TRANSFORMERS >= Version("5.17")
    else f"transformers {TRANSFORMERS} has no every_n_layers/offload (added to the enable call in 5.17)"
)
pytestmark = pytest.mark.skipif(bool(OUT_OF_RANGE), reason=OUT_OF_RANGE)


@pytest.mark.parametrize("path", PATHS)
def test_every_n_layers_and_offload_survive_gcpatch(script_runs, path):
    run = script_runs.get(SCRIPT, "--path", path, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["use_reentrant"] is True, (
        r
    )  # kept: R2's input-grads hook makes the user's reentrant exact
    assert r["checkpointed_layers"] == EVERY_OTHER, r
    assert r["checkpoint_functions"] == OFFLOADING, r


@pytest.mark.parametrize("path", PATHS)
def test_plain_transformers_honours_every_n_layers_and_offload(script_runs, path):
    run = script_runs.get(SCRIPT, "--path", path, gcpatch=False)
    assert_plain(run)
    r = run.result
    assert r["use_reentrant"] is True
    assert r["checkpointed_layers"] == EVERY_OTHER, r
    assert r["checkpoint_functions"] == OFFLOADING, r
