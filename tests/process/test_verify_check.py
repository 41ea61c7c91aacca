"""gcpatch.verify in a fresh interpreter on real tiny models: what it measures (a double
recompute, a lost gradient), and what it leaves behind (nothing: hooks, swapped checkpoint
functions, `.grad` objects and the RNG stream are as they were; it runs once per model)."""

from __future__ import annotations

from importlib import metadata

import pytest
from packaging.version import Version
from testkit.harness import result_of, run_python
from testkit.subproc import requires_transformers

try:
    _TRANSFORMERS = Version(metadata.version("transformers"))
except metadata.PackageNotFoundError:
    _TRANSFORMERS = Version("0")

pytestmark = requires_transformers

MODEL = """
import json, sys, torch, warnings
warnings.filterwarnings("ignore")
from transformers import LlamaConfig, LlamaForCausalLM
def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1, tie_word_embeddings=False)).train()
ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(1))
def funcs(model):
    return {n: vars(m).get("_gradient_checkpointing_func") for n, m in model.named_modules()}
def hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
def root_pre_hooks(model):
    return sorted(getattr(h, "__name__", type(h).__name__) for h in model._forward_pre_hooks.values())
"""


def test_check_leaves_grads_rng_hooks_and_checkpoint_functions_as_they_were(tmp_path):
    code = (
        MODEL
        + """
from gcpatch import verify
model = llama()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
model(input_ids=ids, labels=ids).loss.backward()  # the user already has gradients
grads = {n: p.grad for n, p in model.named_parameters()}
values = {n: p.grad.clone() for n, p in model.named_parameters()}
f, h, rng = funcs(model), hooks(model), torch.get_rng_state()
rep = verify.check(model, (), {"input_ids": ids, "labels": ids}, rows=2)
print("RESULT " + json.dumps({
    "same_grad_objects": all(p.grad is grads[n] for n, p in model.named_parameters()),
    "same_grad_values": all(torch.equal(p.grad, values[n]) for n, p in model.named_parameters()),
    "same_funcs": all(funcs(model)[n] is f[n] for n in f), "hooks_before": h, "hooks_after": hooks(model),
    "rng_same": torch.equal(torch.get_rng_state(), rng), "match": rep.gradients_match, "rows": rep.rows,
    "blocks": rep.blocks, "saved": rep.saved_fraction, "tensors": rep.tensors}))
"""
    )
    r = result_of(run_python(code, tmp_path, GCPATCH="0"))
    assert r["same_grad_objects"] and r["same_grad_values"] and r["same_funcs"] and r["rng_same"], r
    assert r["hooks_after"] == r["hooks_before"], r
    assert r["match"] and r["rows"] == 2 and r["tensors"] == 21
    assert r["blocks"] == {
        "model.layers.0": {"forward": 1, "backward": 1},
        "model.layers.1": {"forward": 1, "backward": 1},
    }
    assert r["saved"] > 0.6


@pytest.mark.skipif(
    _TRANSFORMERS < Version("4.52"),
    reason=(
        "before transformers 4.52 the loop owner checkpoints the layer it is handed, here FSDP's wrapper: the "
        "reentrant wrapper then nests inside transformers' non-reentrant checkpoint and each block runs once"
    ),
)
def test_double_recompute_from_two_tools_is_reported(tmp_path):
    """transformers' checkpointing plus torch's reentrant checkpoint_wrapper (what FSDP/accelerate
    apply) around the same decoder layers: each block runs twice in the backward. (Two
    non-reentrant checkpoints nest without a second recompute.)"""
    code = (
        MODEL
        + """
import functools
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from gcpatch import verify
model = llama()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT))
rep = verify.check(model, (), {"input_ids": ids, "labels": ids})
print("RESULT " + json.dumps({"blocks": rep.blocks, "problems": rep.problems(), "line": rep.line(),
                              "match": rep.gradients_match}))
"""
    )
    r = result_of(run_python(code, tmp_path, GCPATCH="0"))
    assert r["match"], r  # still exact, only slower
    assert sorted(runs["backward"] for runs in r["blocks"].values()) == [2, 2], r["blocks"]
    assert any("recomputed more than once" in p for p in r["problems"]), r["problems"]
    assert "x2" in r["line"]


def test_armed_verify_runs_once_at_the_first_training_forward_then_is_gone(tmp_path):
    code = (
        MODEL
        + """
import gcpatch
model = llama()
model.gradient_checkpointing_enable()
h_armed = root_pre_hooks(model)
with torch.no_grad():
    model(input_ids=ids)  # no graph: not a training step, verify waits
waiting = len([e for e in gcpatch.decisions() if e.get("stage") == "verify"])
for _ in range(3):
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad()
verified = [e for e in gcpatch.decisions() if e.get("stage") == "verify"]
print("RESULT " + json.dumps({"waiting": waiting, "verified": len(verified), "hooks_armed": h_armed,
                              "hooks_after": root_pre_hooks(model), "match": verified[0]["verify"]["gradients_match"]}))
"""
    )
    r = result_of(run_python(code, tmp_path, GCPATCH="1", GCPATCH_VERIFY="1"))
    assert r["waiting"] == 0 and r["verified"] == 1 and r["match"], r
    # armed: the first step's hook on the model beside R5's one-shot one; both gone after step one
    assert r["hooks_armed"] == ["_Before", "_FirstForward"] and r["hooks_after"] == [], r


def test_verify_off_by_default_arms_nothing(tmp_path):
    code = (
        MODEL
        + """
import gcpatch
model = llama()
model.gradient_checkpointing_enable()
armed = root_pre_hooks(model)
model(input_ids=ids, labels=ids).loss.backward()
print("RESULT " + json.dumps({"hooks_armed": armed, "hooks_after": root_pre_hooks(model),
                              "verified": len([e for e in gcpatch.decisions() if e.get("stage") == "verify"])}))
"""
    )
    r = result_of(run_python(code, tmp_path, GCPATCH="1"))
    # no verify hook: on the model only R5's one-shot first-forward hook, gone after step one
    assert r == {"hooks_armed": ["_FirstForward"], "hooks_after": [], "verified": 0}


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False), ("", False)])
def test_gcpatch_verify_setting(tmp_path, value, on):
    code = "import json; from gcpatch import settings; print('RESULT ' + json.dumps({'on': settings.read().verify}))"
    assert result_of(run_python(code, tmp_path, GCPATCH="0", GCPATCH_VERIFY=value))["on"] is on
