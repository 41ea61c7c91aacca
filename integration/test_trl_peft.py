"""TRL SFTTrainer and DPOTrainer (tiny Llama, tokenizer built in the script, tiny
in-memory datasets.Dataset, 2 steps, use_cpu=True) with peft_config=LoraConfig(...) and
gradient_checkpointing=True, no checkpoint kwargs.

gcpatch: trains, the Trainer's enable is decided by R1 (PEFT -> non-reentrant) with nothing recorded
as the user's ask (a use_reentrant TRL writes into TrainingArguments, T1 below transformers 5, is
attributed to the trainer), and after TRL's disable_gradient_checkpointing context the layers hold
gcpatch's choice again. Plain 4.57 trains with reentrant (transformers 4.x default; TRL 0.24 does
not write T1's False).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("peft")
pytest.importorskip("trl")
pytest.importorskip("datasets")

from importlib import metadata  # noqa: E402

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

OUT_OF_RANGE = outside_plugin_range("peft") or outside_plugin_range("trl")
pytestmark = pytest.mark.skipif(bool(OUT_OF_RANGE), reason=OUT_OF_RANGE)

# transformers 4.47 calls `self.log(logs, start_time)` in the training loop (trainer.py); TRL's
# DPOTrainer.log(logs) takes start_time only from trl 0.13.0 (trl/trainer/dpo_trainer.py), so DPO
# with trl 0.12 on transformers >= 4.47 raises TypeError at its first log, with or without gcpatch.
TRL = Version(metadata.version("trl"))
DPO_BROKEN = (
    f"trl {TRL}'s DPOTrainer.log() takes no start_time, which transformers {TRANSFORMERS} passes "
    "(added to DPOTrainer in trl 0.13.0)"
    if TRANSFORMERS >= Version("4.47") and TRL < Version("0.13")
    else ""
)

SCRIPT = "trl_peft.py"
RUNS = [Spec(SCRIPT, ("--trainer", t)) for t in ("sft", "dpo") if not (t == "dpo" and DPO_BROKEN)]
TRAINERS = [
    pytest.param("sft", id="SFTTrainer"),
    pytest.param(
        "dpo", id="DPOTrainer", marks=pytest.mark.skipif(bool(DPO_BROKEN), reason=DPO_BROKEN)
    ),
]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_trl_peft_trains_with_gcpatchs_choice_before_and_after_disable_context(
    script_runs, trainer
):
    run = script_runs.get(SCRIPT, "--trainer", trainer, gcpatch=True)
    assert_installed_gcpatch_ran(run)
    r = run.result
    assert r["global_step"] == 2 and len(r["train_losses"]) == 2 and r["losses_finite"], r
    assert r["peft_model"].startswith("PeftModel") and r["trainable"] == 8
    chosen = final_enable_record(run)["applied"]["use_reentrant"]
    assert chosen is False
    assert r["use_reentrant_after_train"] is chosen
    assert (
        r["use_reentrant_after_disable"] is chosen
    )  # TRL's re-enable on exit gets gcpatch's decision
    # gcpatch changes no number of this run: same losses as the plain run
    plain = script_runs.get(SCRIPT, "--trainer", trainer, gcpatch=False).result
    assert all(
        math.isclose(a, b, abs_tol=1e-4) for a, b in zip(r["train_losses"], plain["train_losses"])
    )


@pytest.mark.parametrize("trainer", TRAINERS)
def test_trl_trainer_enable_is_r1_and_not_the_users_ask(script_runs, trainer):
    run = script_runs.get(SCRIPT, "--trainer", trainer, gcpatch=True)
    r = run.result
    recs = enable_records(run, "trainer")
    # the Trainer's enable; DPOTrainer (TRL 1.x) also re-enables inside train() on leaving its
    # disable_gradient_checkpointing context for the reference forward: each is decided the same
    assert len(recs) >= 1, [x["source"] for x in enable_records(run)]
    assert all(x["applied"]["use_reentrant"] is False and winner(x) == "R1" for x in recs)
    assert all(x["asked"]["use_reentrant"] is None for x in recs)
    rec = recs[0]
    assert rec["facts"]["trainer"].startswith("trl.") and rec["facts"]["peft"] is True
    assert rec["applied"]["use_reentrant"] is False
    assert winner(rec) == "R1"
    assert rec["asked"]["use_reentrant"] is None  # the user named none
    assert r["user_gc_kwargs"] == {}
    if (
        "use_reentrant" in r["gc_kwargs_after_train"]
    ):  # TRL wrote T1 (TRL >= 1.x below transformers 5)
        assert "was set by" in rec["asked"]["from"] and "not by the user" in rec["asked"]["from"], (
            rec["asked"]
        )
    else:
        assert "unset" in rec["asked"]["from"], rec["asked"]
    # the re-enable made by the disable context on exit: no ask, same choice
    after = final_enable_record(run)
    assert after["source"] == "call" and after["asked"]["use_reentrant"] is None
    assert after["applied"]["use_reentrant"] is False
    assert_explain_lists_every_decision(run)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_plain_trl_peft(script_runs, trainer):
    run = script_runs.get(SCRIPT, "--trainer", trainer, gcpatch=False)
    assert_plain(run)
    r = run.result
    assert r["global_step"] == 2 and r["losses_finite"]
    expected = (
        False if V5 or "use_reentrant" in r["gc_kwargs_after_train"] else True
    )  # 4.x default: reentrant
    assert r["use_reentrant_after_train"] is expected
    assert r["use_reentrant_after_disable"] is expected
