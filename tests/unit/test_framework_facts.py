"""Framework facts (`gcpatch_facts`): a plugin publishes what it knows about its framework for
other plugins' rules, so no plugin copies another's release gate. R1 under ZeRO-3 reads the
deepspeed plugin's `zero3_nonreentrant_recompute` (its R3 gate): it applies where the DeepSpeed
release recomputes partitioned frozen parameters non-reentrant, and stands back where R3's
reentrant + hook is the only choice that does not crash."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from test_plugin_votes import facts, rules_voted

from gcpatch.hookspecs import hookimpl
from gcpatch.manager import PluginFailure, PluginHost
from gcpatch.resolve import resolve, stance_votes
from gcpatch.schema import REQUIRED, USE_REENTRANT, ZERO3_NONREENTRANT_RECOMPUTE, PluginInfo


def plugin(name: str):
    return importlib.import_module(f"gcpatch_plugins.{name}")


class AsInstalled:
    """A built-in plugin as if its framework were installed: these tests are about the decision,
    and the fast suite runs where deepspeed is not installed."""

    def __init__(self, module) -> None:
        self.module = module

    @hookimpl
    def gcpatch_plugin_info(self):
        return dataclasses.replace(
            self.module.gcpatch_plugin_info(), framework="pluggy", versions=">=0", proven=""
        )

    @hookimpl
    def gcpatch_vote(self, facts):
        return self.module.gcpatch_vote(facts)

    @hookimpl
    def gcpatch_facts(self, facts):
        hook = getattr(self.module, "gcpatch_facts", None)
        return hook(facts) if hook is not None else {}


def _host(*names: str) -> PluginHost:
    host = PluginHost()
    for name in names:
        host.add(AsInstalled(plugin(name)), name)
    return host


@pytest.mark.parametrize(
    "version,fixed", [("0.18.9", False), ("0.19.2", False), ("0.19.3", True), ("0.20.0", True)]
)
def test_deepspeed_publishes_its_recompute_gate_under_zero3_only(version, fixed):
    ds = plugin("deepspeed")
    assert ds.gcpatch_facts(facts(zero3=True, versions={"deepspeed": version})) == {
        ZERO3_NONREENTRANT_RECOMPUTE: fixed
    }
    assert ds.gcpatch_facts(facts(zero3=False, versions={"deepspeed": version})) == {}


def test_r1_under_zero3_follows_the_published_gate():
    tf = plugin("transformers")
    frozen = dict(zero3=True, frozen_params=50, asked_use_reentrant=True)
    assert rules_voted(
        tf.gcpatch_vote(facts(**frozen, framework_facts={ZERO3_NONREENTRANT_RECOMPUTE: True}))
    ) == [("R1", False, REQUIRED)]
    assert (
        rules_voted(
            tf.gcpatch_vote(facts(**frozen, framework_facts={ZERO3_NONREENTRANT_RECOMPUTE: False}))
        )
        == []
    )
    assert (
        rules_voted(tf.gcpatch_vote(facts(**frozen))) == []
    )  # unknown (no deepspeed plugin): stands back
    config = dict(stage="config", zero3=True, frozen_params=1, trainable_params=1)
    assert rules_voted(
        tf.gcpatch_vote(facts(**config, framework_facts={ZERO3_NONREENTRANT_RECOMPUTE: True}))
    ) == [("R1", False, REQUIRED)]
    assert rules_voted(tf.gcpatch_vote(facts(**config))) == []


@pytest.mark.parametrize("version,rule,value", [("0.18.9", "R3", True), ("0.19.3", "R1", False)])
def test_the_whole_decision_under_zero3_with_both_plugins(version, rule, value):
    host = _host("transformers", "deepspeed")
    f = host.with_framework_facts(
        facts(
            zero3=True,
            frozen_params=50,
            asked_use_reentrant=True,
            asked_from="the user",
            versions={"transformers": "5.23.0", "deepspeed": version},
        )
    )
    decision = resolve(stance_votes(f) + host.votes(f), "fix")
    assert decision.winners[USE_REENTRANT].rule == rule and decision.values[USE_REENTRANT] is value
    assert not decision.conflicts  # R1 and R3 never both vote: no crash chosen over a gradient loss
    assert f.to_dict()["framework_facts"] == {ZERO3_NONREENTRANT_RECOMPUTE: rule == "R1"}


class _FactsPlugin:
    def __init__(self, name: str, answer: object) -> None:
        self.name, self.answer = name, answer

    @hookimpl
    def gcpatch_plugin_info(self):
        return PluginInfo(name=self.name, framework="pluggy", versions=">=0")

    @hookimpl
    def gcpatch_facts(self, facts):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_a_failing_or_garbage_facts_plugin_is_left_out_with_a_warning(caplog):
    host = PluginHost()
    host.add(_FactsPlugin("good", {"a": 1}), "good")
    host.add(_FactsPlugin("raises", RuntimeError("boom")), "raises")
    host.add(_FactsPlugin("garbage", ["not", "a", "mapping"]), "garbage")
    host.add(_FactsPlugin("clash", {"a": 2, "b": 3}), "clash")
    with caplog.at_level("WARNING", logger="gcpatch"):
        f = host.with_framework_facts(facts())
    assert dict(f.framework_facts) == {"a": 1, "b": 3}
    assert (
        "plugin raises dropped from this decision, its gcpatch_facts failed (RuntimeError: boom)"
        in caplog.text
    )
    assert "garbage dropped" in caplog.text and "fact 'a'=2, already 1" in caplog.text
    strict = PluginHost(strict=True)
    strict.add(_FactsPlugin("raises", RuntimeError("boom")), "raises")
    with pytest.raises(PluginFailure, match="raised in gcpatch_facts: RuntimeError: boom"):
        strict.with_framework_facts(facts())


def test_no_plugin_facts_leave_the_facts_unchanged():
    f = facts()
    assert _host("transformers").with_framework_facts(f) is f
