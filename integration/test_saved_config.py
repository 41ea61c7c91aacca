"""The user's artefacts stay theirs (integration/scripts/save_after_training.py). Where R6
switches `use_cache` off on the live config for training (a Llama trained in eval mode, whose
cache transformers keeps on: R5 with R6 at the first training forward), what `save_pretrained`
writes after training under gcpatch is what a plain run writes, byte for byte in config.json and
generation_config.json; the reloaded model returns a KV cache where the plain one does. Before,
config.json said `"use_cache": false` (transformers 4.x moved it into generation_config.json and
set the live config's to None) and the reloaded model returned no cache. A Llama trained in train
mode keeps its config as it is: transformers turns the cache off itself there.
"""

from __future__ import annotations

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain
from _run import V5, Spec

pytest.importorskip("peft")

SCRIPT = "save_after_training.py"
RUNS = [Spec(SCRIPT)]


@pytest.fixture(scope="module")
def runs(script_runs):
    gc, plain = script_runs.get(SCRIPT, gcpatch=True), script_runs.get(SCRIPT, gcpatch=False)
    assert_installed_gcpatch_ran(gc)
    assert_plain(plain)
    return gc.result, plain.result


@pytest.mark.parametrize("model", ["llama", "llama_eval", "lora_merged"])
def test_saved_configs_equal_a_plain_runs_and_the_reload_keeps_its_cache(runs, model):
    got, plain = runs[0][model], runs[1][model]
    assert got["files"] == plain["files"]
    assert got["files"]["config.json"]["use_cache"] is True
    assert got["reload_cache"] is plain["reload_cache"] is True


def test_training_keeps_r6_after_the_save(runs):
    """R6 still holds for the live model it switched: the next step builds no cache that would
    hold every layer's keys and values; the models it left alone keep the user's value."""
    got, plain = runs
    assert got["llama_eval"]["live_use_cache"] is False
    assert plain["llama_eval"]["live_use_cache"] is True
    assert got["llama_eval"]["json_string_use_cache"] is True  # to_json_string: the user's value
    # 5.x leaves the train-mode Llama's config to transformers' own switch; 4.x: R6 at the enable
    assert plain["llama"]["live_use_cache"] is True
    assert got["llama"]["live_use_cache"] is V5
    merged = plain["lora_merged"]["live_use_cache"] if V5 else False
    assert got["lora_merged"]["live_use_cache"] is merged
