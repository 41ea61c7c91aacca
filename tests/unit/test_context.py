"""The decision context (gcpatch/context.py), in process: who is asking, and which ask a
decision reads when a re-enable names none (the last writer would win, transformers#26221)."""

from __future__ import annotations

from gcpatch import context
from gcpatch.context import EnableCall
from gcpatch.schema import Source


class Model:
    pass


def call(model, asked=None, source=Source.CALL, asked_from="the user's call", keeps_ask="X3"):
    return EnableCall(
        model=model,
        api="gradient_checkpointing_enable",
        source=source,
        asked_kwargs=asked,
        asked_from=asked_from,
        invoke=lambda chosen: None,
        replay=lambda m, a: None,
        keeps_ask=keeps_ask,
    )


def test_asking_nests_and_restores():
    assert context.asker() == context.Asker()
    with context.asking(trainer="T"):
        with context.asking(caller="peft"):
            assert (context.asker().trainer, context.asker().caller) == ("T", "peft")
        assert context.asker().caller is None
    assert context.asker() == context.Asker()


def test_a_re_enable_that_names_none_keeps_the_users_ask():
    model = Model()
    first = context.begin(call(model, {"use_reentrant": True}))
    first.commit({"decision": "first"})
    again = context.begin(
        call(model, None, source=Source.TRAINER, asked_from="nothing (TrainingArguments)")
    )
    assert again.asked == {"use_reentrant": True}
    assert again.asked_from == "the user's call, kept over a re-enable that names none (X3)"
    assert again.chosen(False) == {"use_reentrant": False}


def test_a_trainers_explicit_kwargs_never_become_the_users_ask():
    model = Model()
    ctx = context.begin(call(model, {"use_reentrant": False}, source=Source.TRAINER))
    ctx.commit({})
    assert context.of(model).ask is None and context.of(model).enabled


def test_a_framework_enabling_on_the_users_behalf_is_named():
    model = Model()
    with context.asking(caller="peft.prepare_model_for_kbit_training"):
        ctx = context.begin(call(model, None, asked_from="nothing"))
    assert ctx.source == "peft.prepare_model_for_kbit_training"
    assert ctx.asked_from == "nothing (peft.prepare_model_for_kbit_training)"


def test_a_redecision_replays_the_users_ask():
    model = Model()
    context.begin(call(model, {"use_reentrant": True})).commit({})
    with context.asking(redecided_by="DDP(find_unused_parameters=True) (R4)"):
        ctx = context.begin(call(model, None))
    assert ctx.source == "DDP(find_unused_parameters=True) (R4)"
    assert ctx.asked == {"use_reentrant": True} and "decided again" in ctx.asked_from


class Other:
    pass


def test_models_of_one_class_are_numbered_in_the_order_met():
    context.reset()
    first, second, other = Model(), Model(), Other()
    for m in (first, other, second, first):
        context.of(m)
    assert [context.name(m) for m in (first, second, other)] == ["Model", "Model #2", "Other"]
    assert context.name(Model()) == "Model"  # a model gcpatch never met is not numbered
    context.reset()
    assert context.name(second) == "Model"  # numbers live as long as the activation


def test_the_same_decision_on_two_models_is_two_entries_and_a_repeat_on_one_is_a_count():
    """Two models of one class decided alike (a policy and its reference copy) are two entries
    that `gcpatch explain` tells apart; the same model decided again (an RL loop's disable and
    enable) is a count on its entry."""
    from gcpatch import headline, record

    record.reset()
    entry = {"stage": "disable", "model": "Model", "api": "gradient_checkpointing_disable"}
    line = "gcpatch: Model: gave back nothing"
    for instance in (1, 2, 1, 1):
        record.event({**entry, "instance": instance, "line": line}, None)
    kept = record.history()
    assert [e["instance"] for e in kept] == [1, 2], kept
    assert kept[0]["repeats"] == 2 and "repeats" not in kept[1]
    decided = {**entry, "stage": "enable", "instance": 2, "applied": {}}
    assert headline.line(decided).startswith("gcpatch: Model #2: ")
    record.reset()
