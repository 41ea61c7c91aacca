"""A user's own test suite, as the README shows it: it never imports gcpatch; the
`gcpatch_verify` fixture comes from gcpatch's pytest11 entry point. Run by
integration/test_pytest_plugin.py in a fresh pytest process; the failing tests are meant to fail
(their messages are what the user reads)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import _common as c  # noqa: E402
import _kwarg_model  # noqa: E402


def test_llama_checkpointing_is_exact_and_saves(gcpatch_verify):
    model = c.llama().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = c.input_ids(batch=2)
    before = torch.get_rng_state()
    report = gcpatch_verify(model, {"input_ids": ids, "labels": ids}, min_saved=0.5)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.grad is None for p in model.parameters())
    assert report.saved_fraction > 0.5 and report.max_rel_diff == 0
    print(f"USER-REPORT {report.line()}")
    assert os.environ.get("GCPATCH") is None  # the fixture did not switch gcpatch on


def test_custom_model_with_reentrant_fails_naming_parameters(gcpatch_verify):
    model = _kwarg_model.build().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = c.input_ids(batch=2)
    gcpatch_verify(model, {"input_ids": ids, "labels": ids})


def test_model_left_in_eval_mode_fails_on_memory(gcpatch_verify):
    model = c.gpt2().eval()
    model.gradient_checkpointing_enable()
    ids = c.input_ids(batch=2)
    gcpatch_verify(model, {"input_ids": ids, "labels": ids})
