"""`gcpatch explain` reads any valid JSON in any field of a record: real records, written by
gcpatch itself on tiny models in this process (LoRA, a frozen-input checkpoint call, nested calls,
context_fn, a model left in eval mode, fix and warn mode), with a field at any depth replaced by
null, a bool, a number, a string, a list or an object, or deleted. Plain and -v: it never raises,
exits 0, shows every intact record as it shows it alone, and names each line it skipped
(file:line and why) in a count. gcpatch/headline.py's readers take a field of the wrong type as
absent, so the console line of a live decision never raises either."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gcpatch import headline  # noqa: E402
from gcpatch.commands import explain  # noqa: E402

EXAMPLES = 3000  # each example is rendered plain and with -v


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).train()


def _lora_and_eval_mode(ids):
    """LoRA over a reentrant ask (R2's hook, the ask kept), then a model left in eval mode in fix
    and in warn mode (R5 applied; R5 left unapplied)."""
    from peft import LoraConfig, get_peft_model

    model = _llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft(input_ids=ids, labels=ids).loss.backward()
    peft.base_model.model.gradient_checkpointing_disable()
    for mode in ("fix", "warn"):
        os.environ["GCPATCH_MODE"] = mode
        model = _llama().eval()
        model.gradient_checkpointing_enable()
        model(input_ids=ids, labels=ids).loss.backward()
    os.environ["GCPATCH_MODE"] = "fix"


class _Block(torch.nn.Module):
    def __init__(self, nested: bool) -> None:
        super().__init__()
        self.outer, self.inner, self.nested = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), nested

    def forward(self, h):
        h = torch.tanh(self.outer(h))
        if self.nested:  # CK2: a checkpoint inside the loop's checkpoint
            return torch.utils.checkpoint.checkpoint(self.inner, h, use_reentrant=False)
        return self.inner(h)


def _calls():
    """Direct checkpoint calls: a frozen embedding's output into a reentrant block (CK1), a block
    nested in another checkpoint (CK2), context_fn with reentrant asked (CK3 over the ask) and,
    in warn mode, with torch's default (the default kept over CK3)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    embed = torch.nn.Embedding(10, 8).requires_grad_(False)
    for nested in (False, True):
        block = _Block(nested)
        checkpoint(block, embed(torch.tensor([[1, 2, 3]])), use_reentrant=True).sum().backward()
    policy = functools.partial(create_selective_checkpoint_contexts, lambda *a, **k: True)
    x = torch.ones(2, 8, requires_grad=True)
    checkpoint(block.inner, x, use_reentrant=True, context_fn=policy).sum().backward()
    os.environ["GCPATCH_MODE"] = "warn"
    with contextlib.suppress(ValueError):  # warn mode keeps torch's reentrant: torch refuses it
        checkpoint(block.inner, x, context_fn=policy)
    os.environ["GCPATCH_MODE"] = "fix"


@pytest.fixture(scope="module")
def real_records(tmp_path_factory) -> list[str]:
    """The JSONL lines gcpatch wrote under GCPATCH_RECORD for the set-ups above."""
    from gcpatch import engine
    from gcpatch.call import checkpoint_call

    record_dir = tmp_path_factory.mktemp("record")
    logger = logging.getLogger("gcpatch")
    kept = (logger.level, logger.propagate, list(logger.handlers), dict(os.environ))
    os.environ.update(GCPATCH_RECORD=str(record_dir), GCPATCH_MODE="fix", GCPATCH_LOG="off")
    engine.start()
    try:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        _lora_and_eval_mode(ids)
        _calls()
    finally:
        engine.stop()
        checkpoint_call.reset()
        os.environ.clear()
        os.environ.update(kept[3])
        logger.setLevel(kept[0])
        logger.propagate = kept[1]
        logger.handlers[:] = kept[2]
    lines = (record_dir / "gcpatch-rank0.jsonl").read_text().splitlines()
    stages = {json.loads(line).get("stage") for line in lines}
    assert {"enable", "first_forward", "call", "disable"} <= stages, stages
    return lines


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mutated")


def _explain(path: Path, verbose: bool) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = explain.main(str(path), verbose)
    return code, out.getvalue(), err.getvalue()


def _paths(value, at=()):
    """Every place in a JSON value: the value itself, and each key or item at any depth."""
    yield at
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*at, index))


DELETE = object()
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
REPLACEMENTS = st.one_of(
    st.just(DELETE),
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.dictionaries(
        st.sampled_from(["rule", "value", "knob", "strength", "x"]), SCALARS, max_size=3
    ),
)


def _mutate(record: dict, path: tuple, value) -> dict:
    if not path:
        return record if value is DELETE else value  # the whole line replaced by other JSON
    parent = record
    for key in path[:-1]:
        parent = parent[key]
    if value is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return record


@st.composite
def mutations(draw, count: int):
    """(line index, path, replacement) for one to three places in the record."""
    return [
        (draw(st.integers(0, count - 1)), draw(st.integers(0, 10**6)), draw(REPLACEMENTS))
        for _ in range(draw(st.integers(1, 3)))
    ]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_explain_survives_any_json_in_any_field_of_a_real_record(real_records, scratch, data):
    records = [json.loads(line) for line in real_records]
    changed: set[int] = set()
    for index, pick, value in data.draw(mutations(len(records))):
        places = list(_paths(records[index]))
        records[index] = _mutate(records[index], places[pick % len(places)], value)
        changed.add(index)
    for record in records:  # the console's readers, as a live decision's line uses them
        if isinstance(record, dict):
            said = [headline.line(record), headline.line(record, None), headline.detail(record)]
            assert all(isinstance(text, str) for text in said + headline.warnings(record))
            assert headline.level(record) in (logging.INFO, logging.WARNING)
    folder = scratch
    (folder / "gcpatch-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for verbose in (False, True):
        code, out, err = _explain(folder, verbose)
        assert code == 0 and "Traceback" not in err, (code, err)
        assert "cannot be shown" not in err, err  # every record object is read, none given up
        named = re.findall(r"gcpatch-rank0\.jsonl:(\d+): ", err)
        assert {int(n) - 1 for n in named} <= changed, (named, changed, err)
        said = re.search(r"skipped (\d+) damaged line", err)
        assert len(named) == (int(said.group(1)) if said else 0), err
        event("a line skipped, named" if named else "every line shown")
        for index in set(range(len(records))) - changed:  # each intact record shown as alone
            for text in explain.entry_lines(json.loads(real_records[index]), verbose):
                assert text in out, (text, out)


def _real(real_records, stage: str, has: str) -> dict:
    return next(
        json.loads(line)
        for line in real_records
        if json.loads(line).get("stage") == stage and has in line
    )


def test_a_winner_that_is_not_an_object_is_read_as_absent(real_records):
    """`decision.winners.use_reentrant: true`: _kept_through_hook read it as an object
    (AttributeError, without -v too); now the line stands without the winner's rule."""
    entry = _real(real_records, "enable", '"input_grads_hook": true')
    entry["decision"]["winners"]["use_reentrant"] = True
    assert headline.line(entry).startswith("gcpatch: LlamaForCausalLM")
    assert headline.warnings(entry) == [] and headline.detail(entry)
    assert explain.entry_lines(entry, verbose=False)[0].startswith("gcpatch: LlamaForCausalLM")


def test_overruled_votes_that_are_not_a_list_are_read_as_absent(real_records):
    """`decision.overruled: 5`: iterated as a list (TypeError)."""
    entry = _real(real_records, "enable", '"input_grads_hook": true')
    entry["decision"]["overruled"] = 5
    assert "use_reentrant" in headline.line(entry)
    assert isinstance(headline.warnings(entry), list)


def test_the_detail_of_a_record_without_its_source_is_shown(real_records):
    """`-v` on a record without `source`: headline.detail read `entry['source']` (KeyError)."""
    entry = _real(real_records, "enable", '"input_grads_hook": true')
    del entry["source"]
    detail = headline.detail(entry)
    assert "LlamaForCausalLM" in detail and "asked use_reentrant=True" in detail, detail
    lines = explain.entry_lines(entry, verbose=True)
    assert lines[0].startswith("gcpatch: LlamaForCausalLM"), lines


def test_a_record_explain_cannot_show_is_counted_and_named(real_records, tmp_path, monkeypatch):
    """The last guard, where a rendering still fails (a fault injected into headline.line): the
    record is named with its file and line and why, the others shown, exit 0."""
    (tmp_path / "gcpatch-rank0.jsonl").write_text("\n".join(real_records) + "\n")
    real_line = headline.line

    def failing(entry, *args, **kwargs):
        if entry.get("stage") == "call":
            raise RuntimeError("injected")
        return real_line(entry, *args, **kwargs)

    monkeypatch.setattr(headline, "line", failing)
    code, out, err = _explain(tmp_path, verbose=False)
    calls = [n for n, line in enumerate(real_records, 1) if '"stage": "call"' in line]
    assert code == 0 and calls and "gcpatch: LlamaForCausalLM" in out, (code, out, err)
    assert f"skipped {len(calls)} damaged line(s)" in err, err
    for number in calls:
        assert f"gcpatch-rank0.jsonl:{number}: cannot be shown (RuntimeError: injected)" in err, err
