"""a tiny Llama saved and reloaded with BitsAndBytesConfig(load_in_4bit=True) on
CPU, default checkpointing (no kwargs), LoRA, without and with prepare_model_for_kbit_training.

Plain 4.57 without prepare: transformers 4.x defaults to reentrant and the frozen 4-bit base leaves
the loss without a graph ("element 0 of tensors does not require grad"). gcpatch: non-reentrant,
every LoRA gradient equals the no-checkpointing run of the same quantized model, and the enable
made inside prepare_model_for_kbit_training is recorded as peft's (P3).
"""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from _asserts import (
    assert_explain_lists_every_decision,
    assert_installed_gcpatch_ran,
    assert_plain,  # noqa: E402
    enable_records,
    final_enable_record,
    winner,
)
from _run import TRANSFORMERS, V5, Spec, outside_plugin_range  # noqa: E402
from packaging.version import Version  # noqa: E402

# The runs load the 4-bit model on the CPU (device_map="cpu"), which transformers refuses before 4.53,
# with or without gcpatch: 4.35-4.44 raise "No GPU found" (quantizers/quantizer_bnb_4bit.py), 4.45-4.52
# drop "cpu" from the devices bitsandbytes may use unless IPEX is installed (integrations/bitsandbytes.py,
# "Only Intel CPU is supported by BNB at the moment"; 4.45-4.50 crash doing so on a frozenset).
NO_CPU_4BIT = (
    ""
    if TRANSFORMERS >= Version("4.53")
    else (
        f"transformers {TRANSFORMERS} refuses bitsandbytes 4-bit on a CPU without IPEX (allowed from 4.53)"
    )
)
OUT_OF_RANGE = outside_plugin_range("peft") or NO_CPU_4BIT
pytestmark = pytest.mark.skipif(bool(OUT_OF_RANGE), reason=OUT_OF_RANGE)

SCRIPT = "qlora_4bit.py"
RUNS = [Spec(SCRIPT, ("--prepare", p)) for p in ("no", "yes")]
PREPARE = [
    pytest.param("no", id="no-prepare"),
    pytest.param("yes", id="prepare_model_for_kbit_training"),
]


@pytest.mark.parametrize("prepare", PREPARE)
def test_qlora_gets_reference_gradients(script_runs, prepare):
    run = script_runs.get(SCRIPT, "--prepare", prepare, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["quantized_linear"] == "Linear4bit"
    assert r["error"] is None, r["error"]
    assert r["trainable"] == 8
    assert r["wrong"] == 0 and r["grad_none"] == 0, r[
        "wrong_names"
    ]  # allclose 1e-5 (the brief allows 1e-4)
    assert r["loss_equal"]
    assert r["applied_use_reentrant"] is False
    last = final_enable_record(run)
    assert last["facts"]["kbit"] is True and last["applied"]["use_reentrant"] is False
    assert winner(last) == "R1"
    assert_explain_lists_every_decision(run)


@pytest.mark.parametrize("prepare", PREPARE)
def test_plain_qlora(script_runs, prepare):
    run = script_runs.get(SCRIPT, "--prepare", prepare, gcpatch=False)
    assert_plain(run)
    r = run.result
    if (
        prepare == "yes"
    ):  # peft enables with no kwargs: torch's own default (reentrant) + peft's hook
        assert r["error"] is None and r["wrong"] == 0, r
        assert r["applied_use_reentrant"] == "unset"
    elif V5:  # 5.x defaults to non-reentrant
        assert r["error"] is None and r["wrong"] == 0, r
        assert r["applied_use_reentrant"] is False
    else:
        assert "element 0 of tensors does not require grad" in r["error"], r["error"]
        assert r["applied_use_reentrant"] is True


def test_enable_inside_prepare_is_attributed_to_peft(script_runs):
    run = script_runs.get(SCRIPT, "--prepare", "yes", gcpatch=True)
    inside = enable_records(run, "peft.prepare_model_for_kbit_training")
    assert len(inside) == 1, [r["source"] for r in enable_records(run)]
    rec = inside[0]
    assert rec["asked"]["use_reentrant"] is None
    assert "peft.prepare_model_for_kbit_training" in rec["asked"]["from"]
    assert rec["facts"]["kbit"] is True
    # peft enables with `gradient_checkpointing_kwargs={}`: torch's own default (reentrant), exact
    # with the input-grads hook; no rule finds it wrong there, so it is kept (X5); the LoRA wrap
    # after it decides again (R1)
    assert rec["applied"]["use_reentrant"] is True and winner(rec) == "DEFAULT", rec["why"]
    assert rec["facts"]["default_from"] == "torch" and rec["applied"]["input_grads_hook"] is True
    assert_explain_lists_every_decision(run)
