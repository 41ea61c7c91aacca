"""`every_n_layers` through TRL's SFTConfig.gradient_checkpointing_kwargs (transformers 5.17+ pops it
in the Trainer's enable call) survives gcpatch's decision: a 4-layer Llama with frozen embeddings,
use_reentrant=True asked, which gcpatch keeps (R2's input-grads hook makes it exact) and hands to the
framework's enable with the user's other arguments. The layers
gcpatch leaves checkpointed are the user's every 2nd (0 and 2, not all 4), and the first step's
gradients equal the same SFTTrainer's without checkpointing.
"""

from __future__ import annotations

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain, final_enable_record, winner
from _run import TRANSFORMERS, Spec, outside_plugin_range
from packaging.version import Version

pytest.importorskip("trl")
pytest.importorskip("datasets")

SCRIPT = "trl_every_n_layers.py"
RUNS = [Spec(SCRIPT)]
EVERY_OTHER = [0, 2]
OUT_OF_RANGE = outside_plugin_range("trl") or (
    ""
    if TRANSFORMERS >= Version("5.17")
    else f"transformers {TRANSFORMERS} has no every_n_layers (5.17+)"
)
pytestmark = pytest.mark.skipif(bool(OUT_OF_RANGE), reason=OUT_OF_RANGE)


def test_trl_every_n_layers_survives_gcpatch_with_exact_gradients(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["checkpointed_layers"] == EVERY_OTHER, r
    assert r["use_reentrant"] is True  # the asked True, kept: exact through R2's hook
    assert r["trainable"] == 38 and r["wrong"] == 0, r["wrong_names"]
    last = final_enable_record(run)
    assert (
        last["facts"]["trainer"] == "trl.trainer.sft_trainer.SFTTrainer" and winner(last) == "USER"
    )
    assert last["applied"]["checkpointed_stacks"] == {"model.layers": "2 of 4 LlamaDecoderLayer"}


def test_plain_trl_every_n_layers(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=False)
    assert_plain(run)
    r = run.result
    # transformers 5.x's own input-grads hook covers input_ids models: plain reentrant is correct here
    assert (
        r["checkpointed_layers"] == EVERY_OTHER and r["use_reentrant"] is True and r["wrong"] == 0
    ), r
