"""The pytest plugin as a user meets it: a test suite that never imports gcpatch gets the
`gcpatch_verify` fixture from the installed package's pytest11 entry point, and reads a failure
message that names the parameters (the first few) or the missing saving, and what fixes it; it
checks the set-up the test built, with gcpatch off unless the suite runs with GCPATCH=1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _run import child_env

SUITE = Path(__file__).resolve().parent / "user_suite" / "verify_my_model.py"


@pytest.fixture(scope="module")
def user_suite(tmp_path_factory) -> subprocess.CompletedProcess:
    cwd = tmp_path_factory.mktemp("user-suite")  # outside the checkout: the installed gcpatch runs
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-s", "-p", "no:cacheprovider", str(SUITE)],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plugin_passes_a_correct_setup(user_suite):
    out = user_suite.stdout
    assert "PASSED" in out and "test_llama_checkpointing_is_exact_and_saves" in out, out[-3000:]
    assert "USER-REPORT LlamaForCausalLM: gradients match (21 tensors" in out, out[-3000:]
    assert "2 failed, 1 passed" in out, out[-3000:]


def test_plugin_failure_names_the_parameters(user_suite):
    out = user_suite.stdout
    assert "FAILED" in out and "test_custom_model_with_reentrant_fails_naming_parameters" in out
    assert "gcpatch verify: checkpointing on KwargModel is not what it should be" in out, out[
        -4000:
    ]
    assert "13 tensor(s) get no gradient with checkpointing but one without it: embed.weight" in out
    assert "(+5 more)" in out  # the first names; the report (and the record) hold every one
    assert "- fix: use_reentrant=False (gradient_checkpointing_enable(" in out
    message = out.split("is not what it should be", 1)[1].split("\n\n", 1)[0]
    lines = [line.removeprefix("E ").strip() for line in message.splitlines()]
    assert max(len(line) for line in lines) <= 120, lines  # wrapped at a word, nothing cut


def test_plugin_failure_shows_no_saving_in_eval_mode(user_suite):
    out = user_suite.stdout
    assert "gcpatch verify: checkpointing on GPT2LMHeadModel is not what it should be" in out, out[
        -4000:
    ]
    assert "no block was checkpointed in this step (4 module(s) have checkpointing on" in out
    assert "activations saved 0%" in out
