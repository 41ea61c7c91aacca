"""`gcpatch.deactivate(); gcpatch.activate()` behaves as a fresh process: a decision, a memory
budget's plan and a verify made after a re-activation are those a fresh interpreter makes, line for
line and record for record, although the same set-up was decided, planned and verified before it
(every activation state ends at `engine.stop()`, gcpatch/lifetime.py)."""

from __future__ import annotations

import re

import pytest
from testkit.harness import result_of, run_python

pytest.importorskip("transformers")

SCRIPT = """
import json, os, re, sys, torch
import gcpatch
from transformers import LlamaConfig, LlamaForCausalLM

def build():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    model.model.embed_tokens.weight.requires_grad_(False)
    return model

TOOK = r"took [0-9.]+ s"  # the budget's line says what its measuring took: a clock's reading

def train():
    start = len(gcpatch.decisions())
    model = build().train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
    seen = []
    for e in gcpatch.decisions()[start:]:
        seen.append([e.get("stage"), e.get("model"), e.get("applied"), e.get("rules"),
                     re.sub(TOOK, "took N s", e.get("line") or ""), (e.get("budget") or {}).get("flags")])
    return seen, [bool(layer.gradient_checkpointing) for layer in model.model.layers]

if os.environ.get("REACTIVATE") == "1":
    train()
    gcpatch.deactivate()
    print("-- re-activated --", file=sys.stderr, flush=True)
    gcpatch.activate()
seen, flags = train()
print("RESULT " + json.dumps({"seen": seen, "flags": flags}))
"""


def _lines(stderr: str) -> list[str]:
    """The decision lines after the re-activation. A release outside a plugin's proven range is
    said once per process (gcpatch/manager.py `_say_untested`), not once per activation: that
    line is left out of both."""
    after = stderr.split("-- re-activated --")[-1]
    after = re.sub(r"took(\s+)[0-9.]+(\s+)s", r"took\1N\2s", after)  # a clock's, as in SCRIPT
    return [
        line
        for line in after.splitlines()
        if line.startswith("gcpatch:") and not line.startswith("gcpatch: untested ")
    ]


def test_a_reactivation_decides_plans_and_verifies_as_a_fresh_process(tmp_path):
    # whole layers alone: a lever's cost is read off the clock at the first step, so two processes
    # could each take another plan
    env = {
        "GCPATCH": "1",
        "GCPATCH_VERIFY": "1",
        "GCPATCH_MEMORY_BUDGET": "0.5",
        "GCPATCH_BUDGET_LEVERS": "whole",
    }
    fresh = run_python(SCRIPT, tmp_path, **env)
    again = run_python(SCRIPT, tmp_path, REACTIVATE="1", **env)
    first, second = result_of(fresh), result_of(again)
    stages = [entry[0] for entry in first["seen"]]
    assert "enable" in stages and "budget" in stages and "verify" in stages, first
    assert second == first
    assert _lines(again.stderr) == _lines(fresh.stderr) and _lines(fresh.stderr), (
        fresh.stderr,
        again.stderr,
    )
