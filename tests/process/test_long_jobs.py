"""A long job stays flat: an RL-style loop (disable checkpointing, generate, enable it again, train
a step) 1000 times grows the process's memory no more than the same loop without gcpatch (within
2 MB), and its record no more than RECORD_BOUND. A decision that repeats the last one is a count,
not a new entry (gcpatch/record.py): before, each cycle added about 5.5 KiB to the history and
3.4 KiB to the record (1000 cycles: about +7 MB of memory, three times the bound, and a 3.4 MB
record)."""

from __future__ import annotations

import pytest
from testkit.harness import result_of, run_python

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # out of CI's tf525-unit: docs/CI.md

CYCLES = 1000
# Two decisions a cycle (the enable and the disable), each written once and then as a count at the
# 1st, 2nd, 4th ... repeat: about 2 * (1 + log2(1000)) lines of at most 8 KiB, 176 KiB in all.
RECORD_BOUND = 200 * 1024

LOOP = """
import json, os, resource, torch, warnings
warnings.filterwarnings("ignore")
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).train()
opt = torch.optim.SGD(model.parameters(), lr=0.0)
ids = torch.randint(0, 64, (1, 8))

def cycle():
    model.gradient_checkpointing_disable()
    with torch.no_grad():
        model(input_ids=ids)  # "generate"
    model.gradient_checkpointing_enable()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()

def rss_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))

for _ in range(100):  # warm up: allocator and caches settle
    cycle()
start = rss_kib()
for _ in range(CYCLES):
    cycle()
print("RESULT " + json.dumps({"grew_kib": rss_kib() - start}))
""".replace("CYCLES", str(CYCLES))


def test_a_disable_enable_loop_stays_flat_in_memory_and_record(tmp_path):
    plain = result_of(run_python(LOOP, tmp_path, timeout=1200, GCPATCH="0"))
    record_dir = tmp_path / "record"
    ours = result_of(
        run_python(LOOP, tmp_path, timeout=1200, GCPATCH="1", GCPATCH_RECORD=str(record_dir))
    )
    assert ours["grew_kib"] - plain["grew_kib"] <= 2048, (ours, plain)
    size = sum(p.stat().st_size for p in record_dir.glob("*.jsonl"))
    assert 0 < size <= RECORD_BOUND, size
