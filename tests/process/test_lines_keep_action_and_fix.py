"""Every line gcpatch says keeps its subject, action and fix, on the console and in `gcpatch
explain`: a line that must fit one row gives up its reason first, is wrapped where even that does
not fit, never cut ("..."); explain prints it whole; one line a decision, an overruled ask or what
warn mode leaves unapplied said on it with the consequence and the fix, no pointer to a record
that may not exist (gcpatch/headline.py). One child runs, on a tiny Llama from its config or a
hand-written model: the Trainer with PEFT LoRA, PEFT LoRA over an asked use_reentrant=True, a
reentrant call on a frozen embedding's output, two nested checkpoints, context_fn with reentrant
asked (CK3), GCPATCH_MEMORY_BUDGET=0.6, and in warn mode a model left in eval mode (R5) and a call
whose torch default CK3 would change."""

from __future__ import annotations

import importlib.util
import re
import sys
import textwrap
from pathlib import Path

import pytest
from testkit.harness import child_env, messages
from testkit.harness import run as harness_run
from testkit.subproc import requires_transformers

from gcpatch import headline
from gcpatch.commands import explain

pytestmark = [
    requires_transformers,
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft not installed"),
]

SETUPS = textwrap.dedent(
    """
    import functools, os, tempfile, warnings
    warnings.filterwarnings("ignore")
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from peft import LoraConfig, get_peft_model

    def llama():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).train()

    def lora(model):
        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return {"input_ids": ids[0], "labels": ids[0]}

    with tempfile.TemporaryDirectory() as out:  # the Trainer with a PEFT LoRA model
        args = TrainingArguments(output_dir=out, gradient_checkpointing=True, max_steps=1,
            per_device_train_batch_size=2, report_to=[], use_cpu=True, save_strategy="no")
        Trainer(model=lora(llama()), args=args, train_dataset=Rows()).train()

    model = llama()  # PEFT LoRA over an asked reentrant
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    lora(model)(input_ids=ids, labels=ids).loss.backward()

    class Block(nn.Module):
        def __init__(self, nested):
            super().__init__()
            self.outer, self.inner, self.nested = nn.Linear(8, 8), nn.Linear(8, 8), nested
        def forward(self, h):
            h = torch.tanh(self.outer(h))
            return checkpoint(self.inner, h, use_reentrant=False) if self.nested else self.inner(h)

    embed = nn.Embedding(10, 8).requires_grad_(False)
    for nested in (False, True):  # a frozen embedding's output into reentrant blocks; nested
        h = embed(torch.tensor([[1, 2, 3]]))
        for block in (Block(nested), Block(nested)):
            h = checkpoint(block, h, use_reentrant=True)
        h.sum().backward()
    policy = functools.partial(create_selective_checkpoint_contexts, lambda *a, **k: True)
    x = torch.ones(2, 8, requires_grad=True)
    checkpoint(block.inner, x, use_reentrant=True, context_fn=policy).sum().backward()

    os.environ.update(GCPATCH_MEMORY_BUDGET="0.6", GCPATCH_BUDGET_LEVERS="whole")
    model = llama()
    model.gradient_checkpointing_enable()
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    del os.environ["GCPATCH_MEMORY_BUDGET"]

    os.environ["GCPATCH_MODE"] = "warn"  # read at each decision
    model = llama().eval()
    model.gradient_checkpointing_enable()
    model(input_ids=ids, labels=ids).loss.backward()
    try:
        checkpoint(block.inner, x, context_fn=policy)
    except ValueError:  # warn mode keeps torch's reentrant default, which refuses context_fn
        pass
    print("DONE")
    """
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The child's gcpatch messages (each whole: a wrapped one joined) and its record."""
    folder = tmp_path_factory.mktemp("lines")
    (folder / "setups.py").write_text(SETUPS)
    record = folder / "record"
    env = child_env(quiet=True, GCPATCH="1", GCPATCH_RECORD=str(record))
    proc = harness_run([sys.executable, "setups.py"], folder, env, 300)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-4000:]
    rows = [row for row in proc.stderr.splitlines() if row.startswith(("gcpatch", "    "))]
    said = [m for m in messages(proc.stderr) if m.startswith("gcpatch")]
    return rows, said, record


def _explained(record: Path) -> list[str]:
    entries = explain.read(str(record))
    return [text for entry in entries for text in explain.entry_lines(entry, verbose=False)]


def test_no_line_is_cut_on_the_console_or_in_explain(run):
    rows, said, record = run
    shown = _explained(record)
    assert said and shown
    for text in said + shown:
        assert not text.rstrip().endswith("..."), text
        assert " ... " not in text and "(gcpatch explain -v)" not in text, text
    assert all(len(row) <= headline.LIMIT for row in rows), rows  # wrapped, not cut
    assert all("\n" not in text for text in shown)  # explain: one whole line each


def _one(said: list[str], *words: str) -> str:
    found = [text for text in said if all(w in text for w in words)]
    assert len(found) == 1, (words, said)
    return found[0]


@pytest.mark.parametrize(
    "words",
    [
        # PEFT LoRA over use_reentrant=True: the ask kept, made exact by R2's hook
        ("(PeftModel", "use_reentrant=True as asked, exact through the input-grads hook (R2"),
        # the Trainer with a LoRA model: its re-enable's decision
        ("(trainer):", "use_reentrant=False"),
        # the frozen embedding's output into a reentrant block: CK1's fix, the action kept
        ("checkpoint call at setups.py:", "an input that requires grad, reentrant kept (CK1"),
        # the inner of two nested checkpoints
        ("checkpoint call at setups.py:", "runs inline (CK2"),
        # the budget's own line, whole
        ("budget LlamaForCausalLM", "memory budget 0.6"),
    ],
)
def test_each_set_up_says_its_action(run, words):
    _, said, record = run
    line = _one(said, *words)
    assert not line.endswith("...")
    if "budget" not in words[0]:  # a decision: explain shows its action too, whole
        action = words[-1]
        assert any(action in text for text in _explained(record)), _explained(record)


def test_an_overruled_ask_is_one_line_with_its_way_back(run):
    """CK3 over an asked use_reentrant=True: before, a decision line cut to its rule and a second
    warning line; now one line: the rule, the change, and how to keep the ask."""
    _, said, _ = run
    ck3 = [text for text in said if "CK3" in text and "warn mode" not in text]
    assert len(ck3) == 1, said
    assert "CK3 overrules your use_reentrant=True -> False" in ck3[0], ck3
    assert "GCPATCH_MODE=warn keeps it" in ck3[0], ck3


def test_warn_mode_lines_carry_their_consequence_and_fix(run):
    _, said, record = run
    eval_mode = _one(said, "warn mode leaves R5 unapplied")
    assert "checkpointing would silently do nothing" in eval_mode
    assert "call model.train()" in eval_mode
    kept = _one(said, "warn mode keeps use_reentrant=True over CK3")
    assert "it will crash" in kept and "pass use_reentrant=False" in kept, kept
    shown = _explained(record)
    assert any("call model.train()" in text for text in shown), shown
    assert any(re.search(r"over CK3 .*: it will crash; pass use_reentrant=False", t) for t in shown)
