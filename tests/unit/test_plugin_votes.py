"""Each built-in plugin's votes, in process, from facts built by hand: which rule votes on which
set-up, and that every vote names a rule its plugin declares (an unknown id fails here)."""

from __future__ import annotations

import importlib
import itertools
import types

import pytest

from gcpatch.errors import GcpatchError
from gcpatch.hookspecs import hookimpl
from gcpatch.manager import PluginHost
from gcpatch.schema import (
    CRASH,
    EVAL_MODE_FIX,
    GRAD_INPUT,
    INPUT_GRADS_HOOK,
    LIFT_BOUND_TENSORS,
    RECOMMENDED,
    REQUIRED,
    RUN_INLINE,
    TUPLE_OUTPUTS,
    USE_CACHE_OFF,
    USE_REENTRANT,
    WRONG_GRADIENTS,
    CallFacts,
    Facts,
    PluginInfo,
    Rule,
    Stack,
    Vote,
)

PLUGINS = (
    "transformers",
    "peft",
    "trl",
    "deepspeed",
    "ddp",
    "axolotl",
    "colossalai",
    "torch_checkpoint",
    "fsdp",
)


def plugin(name: str):
    return importlib.import_module(f"gcpatch_plugins.{name}")


def facts(**overrides) -> Facts:
    """An all-trainable Llama-like model, enabled by the user's own call, one process."""
    base = dict(
        stage="enable",
        api="gradient_checkpointing_enable",
        source="call",
        model_class="LlamaForCausalLM",
        asked_use_reentrant=None,
        asked_from="nothing",
        asked_kwargs={},
        trainable_params=100,
        frozen_params=0,
        embeddings_trainable=True,
        checkpointed_layers=2,
        trainable_in_checkpointed_layers=True,
        main_input_name="input_ids",
        layers_in_eval_mode=0,
        checkpoint_layer_api=True,
        use_cache=True,
        peft=False,
        kbit=False,
        zero3=False,
        world_size=1,
        distributed="none",
        versions={"transformers": "5.23.0", "deepspeed": None},
    )
    base.update(overrides)
    return Facts(**base)


def call_facts(**overrides) -> CallFacts:
    base = dict(
        asked_use_reentrant=True,
        grad_enabled=True,
        inputs_require_grad=True,
        trainable_inside=True,
        context_fn=False,
        nested=False,
        torch_version="2.13.0",
    )
    base.update(overrides)
    return CallFacts(**base)


def rules_voted(votes, knob=USE_REENTRANT):
    return [(v.rule, v.value, v.strength) for v in votes if v.knob == knob]


def knobs_voted(votes):
    return [(v.rule, v.knob, v.value) for v in votes]


def test_partially_frozen_model_gets_r1_required_non_reentrant():
    votes = plugin("transformers").gcpatch_vote(facts(frozen_params=50))
    assert rules_voted(votes) == [("R1", False, REQUIRED)]
    assert next(v for v in votes if v.rule == "R1").avoids == WRONG_GRADIENTS


def _stack(
    fed: bool, upstream: int = 0, runner_from: str = "transformers.models.llama.modeling_llama"
) -> Stack:
    return Stack(
        stack="model.layers",
        runner="LlamaModel",
        blocks=2,
        block_class="LlamaDecoderLayer",
        trainable_in_blocks=10,
        trainable_upstream=upstream,
        inputs_can_require_grad=upstream > 0,
        blocks_in_eval_mode=0,
        encoder_states_by_keyword=False,
        fed_by_input_embeddings=fed,
        runner_forward_from=runner_from,
    )


def test_r1_recommends_where_the_input_grads_hook_serves_and_requires_where_it_cannot():
    vote = plugin("transformers").gcpatch_vote
    # frozen embeddings feeding the stack: R2's hook makes reentrant exact, so a user's reentrant is kept
    assert rules_voted(vote(facts(frozen_params=50, stacks=(_stack(fed=True),)))) == [
        ("R1", False, RECOMMENDED)
    ]
    # nothing upstream the hook reaches (a vision tower behind a frozen patch embedding): required, as before
    assert rules_voted(vote(facts(frozen_params=50, stacks=(_stack(fed=False),)))) == [
        ("R1", False, REQUIRED)
    ]
    # something upstream trains: the stack's input requires grad, R1 has nothing to say
    assert rules_voted(vote(facts(frozen_params=50, stacks=(_stack(fed=True, upstream=5),)))) == []


def test_all_trainable_model_gets_only_the_input_grads_hook():
    """transformers' own model code turns the cache off itself in a checkpointed training forward:
    the config is the user's (R6 does not vote)."""
    votes = plugin("transformers").gcpatch_vote(facts(stacks=(_stack(fed=True, upstream=5),)))
    assert rules_voted(votes) == []
    assert {v.knob: v.rule for v in votes} == {INPUT_GRADS_HOOK: "R2"}


@pytest.mark.parametrize(
    "runner_from", ["transformers_modules.acme.modeling_acme", "__main__", "my_project.models"]
)
def test_use_cache_off_where_the_layers_forward_is_not_transformers_own_or_on_4x(runner_from):
    """Remote code, a user's own runner: nothing says it drops the cache, so R6 switches it off."""
    stacks = (_stack(fed=True, upstream=5, runner_from=runner_from),)
    votes = plugin("transformers").gcpatch_vote(facts(stacks=stacks))
    assert {v.knob: v.rule for v in votes} == {INPUT_GRADS_HOOK: "R2", USE_CACHE_OFF: "R6"}
    both = (_stack(fed=True, upstream=5), *stacks)  # one stack of each: R6 still votes
    assert USE_CACHE_OFF in {
        v.knob for v in plugin("transformers").gcpatch_vote(facts(stacks=both))
    }
    # 4.x: transformers' own switch logs in every forward (a graph break under torch.compile): R6
    four = facts(stacks=(_stack(fed=True, upstream=5),), versions={"transformers": "4.57.6"})
    assert {v.knob: v.rule for v in plugin("transformers").gcpatch_vote(four)} == {
        INPUT_GRADS_HOOK: "R2",
        USE_CACHE_OFF: "R6",
    }
    # a config without use_cache (an encoder-only family): nothing to switch off
    votes = plugin("transformers").gcpatch_vote(facts(stacks=stacks, use_cache=None))
    assert USE_CACHE_OFF not in {v.knob for v in votes}


def test_eval_mode_at_first_forward_gets_r5_only_with_grad_enabled():
    tf = plugin("transformers")
    assert [
        v.rule for v in tf.gcpatch_vote(facts(stage="first_forward", layers_in_eval_mode=2))
    ] == ["R5"]
    assert (
        tf.gcpatch_vote(facts(stage="first_forward", layers_in_eval_mode=2, grad_enabled=False))
        == []
    )
    assert tf.gcpatch_vote(facts(stage="first_forward", layers_in_eval_mode=0)) == []
    assert [
        v.knob for v in tf.gcpatch_vote(facts(stage="first_forward", layers_in_eval_mode=1))
    ] == [EVAL_MODE_FIX]
    # in eval mode transformers keeps the cache on (its switch reads the runner's `training`), so
    # R5 comes with R6 where the cache is on, and alone where it is already off
    stacks = (_stack(fed=True, upstream=5),)
    eval_first = facts(stage="first_forward", layers_in_eval_mode=1, stacks=stacks)
    assert [(v.rule, v.knob) for v in tf.gcpatch_vote(eval_first)] == [
        ("R5", EVAL_MODE_FIX),
        ("R6", USE_CACHE_OFF),
    ]
    off = facts(stage="first_forward", layers_in_eval_mode=1, stacks=stacks, use_cache=False)
    assert [v.rule for v in tf.gcpatch_vote(off)] == ["R5"]


def test_zero3_with_frozen_params_gets_r3_reentrant_only_below_the_fixed_release():
    ds = plugin("deepspeed")
    old = ds.gcpatch_vote(
        facts(zero3=True, peft=True, frozen_params=50, versions={"deepspeed": "0.18.9"})
    )
    assert rules_voted(old) == [("R3", True, REQUIRED)] and old[0].avoids == CRASH
    assert (
        ds.gcpatch_vote(
            facts(zero3=True, peft=True, frozen_params=50, versions={"deepspeed": "0.19.3"})
        )
        == []
    )
    assert (
        ds.gcpatch_vote(
            facts(zero3=False, peft=True, frozen_params=50, versions={"deepspeed": "0.18.9"})
        )
        == []
    )
    # R1 stands back under ZeRO-3 (reentrant is the only working choice there on old releases)
    assert (
        rules_voted(plugin("transformers").gcpatch_vote(facts(zero3=True, frozen_params=50))) == []
    )


def test_ddp_find_unused_over_several_processes_gets_r4():
    ddp = plugin("ddp")
    assert rules_voted(ddp.gcpatch_vote(facts(world_size=2, find_unused_parameters=True))) == [
        ("R4", False, REQUIRED)
    ]
    assert ddp.gcpatch_vote(facts(world_size=1, find_unused_parameters=True)) == []
    assert ddp.gcpatch_vote(facts(world_size=2, find_unused_parameters=False)) == []


def test_kbit_model_gets_p1_hook():
    votes = plugin("peft").gcpatch_vote(facts(kbit=True))
    assert [(v.rule, v.knob) for v in votes] == [("P1", INPUT_GRADS_HOOK)]


def test_trl_trainer_recommends_non_reentrant_below_transformers_5_and_requires_it_for_rl_qlora():
    trl = plugin("trl")
    assert rules_voted(
        trl.gcpatch_vote(facts(trainer="trl.SFTTrainer", versions={"transformers": "4.57.6"}))
    ) == [("T1", False, RECOMMENDED)]
    assert trl.gcpatch_vote(facts(trainer="trl.SFTTrainer")) == []
    assert (
        trl.gcpatch_vote(facts(trainer="transformers.Trainer", versions={"transformers": "4.57.6"}))
        == []
    )
    rl = trl.gcpatch_vote(facts(trainer="trl.GRPOTrainer", kbit=True, peft=True, world_size=2))
    assert ("R4-RL", False, REQUIRED) in rules_voted(rl)


def test_axolotl_votes_only_at_config_time():
    ax = plugin("axolotl")
    assert ax.gcpatch_vote(facts(trainer="axolotl")) == []
    assert rules_voted(ax.gcpatch_vote(facts(stage="config", trainer="axolotl"))) == [
        ("A2", True, RECOMMENDED)
    ]


def test_colossalai_recommends_non_reentrant_on_its_own_redecisions():
    cai = plugin("colossalai")
    assert rules_voted(cai.gcpatch_vote(facts(source="colossalai Booster.boost (C1)"))) == [
        ("C2", False, RECOMMENDED)
    ]
    assert cai.gcpatch_vote(facts()) == []


def test_checkpoint_call_rules():
    vote = plugin("torch_checkpoint").gcpatch_call_vote
    assert vote(call_facts()) == []  # a correct reentrant call
    assert vote(call_facts(asked_use_reentrant=False, inputs_require_grad=False)) == []
    # CK1: reentrant kept and made exact where what is inside is known (one more input that requires
    # grad, or the partial's graph tensors as inputs), non-reentrant where it is not, or where a
    # tensor with a graph reaches the function unseen (a closure, a container argument)
    assert knobs_voted(vote(call_facts(inputs_require_grad=False))) == [("CK1", GRAD_INPUT, True)]
    assert knobs_voted(
        vote(
            call_facts(inputs_require_grad=False, bound_graph_tensors=1, bound_graph_liftable=True)
        )
    ) == [("CK1", LIFT_BOUND_TENSORS, True)]
    assert rules_voted(
        vote(call_facts(asked_use_reentrant=None, inputs_require_grad=False, trainable_inside=None))
    ) == [("CK1", False, REQUIRED)]
    assert rules_voted(vote(call_facts(inputs_require_grad=False, bound_graph_tensors=1))) == [
        ("CK1", False, REQUIRED)
    ]
    assert rules_voted(vote(call_facts(inputs_require_grad=False, container_graph_tensors=1))) == [
        ("CK1", False, REQUIRED)
    ]
    # CK5 on a container argument holding a tensor with a graph; CK7 on what the first result showed
    assert rules_voted(vote(call_facts(container_graph_tensors=2))) == [("CK5", False, REQUIRED)]
    assert knobs_voted(vote(call_facts(outputs_untracked="rebuildable"))) == [
        ("CK7", TUPLE_OUTPUTS, True)
    ]
    assert rules_voted(vote(call_facts(outputs_untracked="opaque"))) == [("CK7", False, REQUIRED)]
    assert vote(call_facts(outputs_untracked="rebuildable", asked_use_reentrant=False)) == []
    assert vote(call_facts(inputs_require_grad=False, trainable_inside=False)) == []
    assert vote(call_facts(inputs_require_grad=False, grad_enabled=False)) == []
    assert rules_voted(vote(call_facts(context_fn=True))) == [("CK3", False, REQUIRED)]
    # CK5: a bound tensor with a graph beside a grad-requiring positional input: passed positionally where it
    # is the partial's own argument (reentrant kept), else non-reentrant; a leaf or no such tensor: nothing
    assert [
        (v.rule, v.knob, v.value)
        for v in vote(call_facts(bound_graph_tensors=1, bound_graph_liftable=True))
    ] == [("CK5", LIFT_BOUND_TENSORS, True)]
    assert rules_voted(vote(call_facts(bound_graph_tensors=2))) == [("CK5", False, REQUIRED)]
    assert vote(call_facts(bound_graph_tensors=1, asked_use_reentrant=False)) == []
    assert vote(call_facts()) == []
    assert (
        vote(call_facts(asked_use_reentrant=False, context_fn=True)) == []
    )  # never made reentrant
    assert [(v.rule, v.knob) for v in vote(call_facts(nested=True))] == [("CK2", RUN_INLINE)]


def test_f2_recommends_non_reentrant_where_the_checkpoint_encloses_fsdps_unshard():
    fsdp = plugin("fsdp").gcpatch_vote
    for kind, site in [
        ("fsdp1", "loop"),
        ("accelerate:fsdp1", "loop"),
        ("fsdp2", "loop"),
        ("fsdp2", "layer_call"),
        ("accelerate:fsdp2", "layer_call"),
    ]:
        votes = fsdp(facts(fsdp=kind, checkpoint_site=site))
        assert rules_voted(votes) == [("F2", False, RECOMMENDED)], (kind, site)
        assert votes[0].kept_cost and "transformers#30404" in votes[0].kept_cost
    assert "FSDP1" in fsdp(facts(fsdp="fsdp1", checkpoint_site="loop"))[0].reason
    assert "FSDP2" in fsdp(facts(fsdp="fsdp2", checkpoint_site="layer_call"))[0].reason
    assert (
        fsdp(facts(fsdp="fsdp1", checkpoint_site="layer_call")) == []
    )  # FSDP1's wrapper stays outside
    assert fsdp(facts(fsdp="fsdp1", checkpoint_site="layer_forward")) == []
    assert (
        fsdp(facts(fsdp="fsdp2", checkpoint_site="layer_forward")) == []
    )  # FSDP2's hooks stay outside
    assert fsdp(facts(fsdp="", checkpoint_site="loop")) == []
    assert fsdp(facts(fsdp="fsdp1", checkpoint_site="")) == []  # no checkpointed layer
    assert fsdp(facts(fsdp="fsdp1", checkpoint_site="loop", stage="first_forward")) == []


def _fact_grid():
    for frozen, zero3, kbit, peft, world, unused, stage, trainer, eval_layers in itertools.product(
        (0, 50),
        (False, True),
        (False, True),
        (False, True),
        (1, 2),
        (False, True),
        ("enable", "config", "first_forward"),
        ("", "trl.GRPOTrainer", "axolotl:rl", "axolotl"),
        (0, 2),
    ):
        yield facts(
            frozen_params=frozen,
            zero3=zero3,
            kbit=kbit,
            peft=peft,
            world_size=world,
            find_unused_parameters=unused,
            stage=stage,
            trainer=trainer,
            layers_in_eval_mode=eval_layers,
            source="colossalai Booster.boost" if trainer == "" and peft else "call",
            versions={"transformers": "4.57.6", "deepspeed": "0.18.9"},
        )
    for fsdp, site, asked in itertools.product(
        ("", "fsdp1", "fsdp2", "accelerate:fsdp1"),
        ("", "loop", "layer_call", "layer_forward"),
        (None, True, False),
    ):
        yield facts(
            fsdp=fsdp,
            checkpoint_site=site,
            asked_use_reentrant=asked,
            checkpoint_layer_api=site != "loop",
        )


def _call_grid():
    for values in itertools.product(
        (None, True, False),
        (True, False),
        (True, False),
        (None, True, False),
        (True, False),
        (True, False),
        (0, 1),
        (False, True),
        (0, 1),
        ("", "rebuildable", "opaque"),
    ):
        yield CallFacts(*values)


@pytest.mark.parametrize("name", PLUGINS)
def test_every_vote_names_a_rule_its_plugin_declares(name):
    module = plugin(name)
    rules = module.gcpatch_plugin_info().rules
    declared = {rule.id for rule in rules if not rule.documents}
    voted = set()
    if hasattr(module, "gcpatch_vote"):
        for f in _fact_grid():
            voted |= {v.rule for v in module.gcpatch_vote(f)}
    if hasattr(module, "gcpatch_call_vote"):
        for f in _call_grid():
            voted |= {v.rule for v in module.gcpatch_call_vote(f)}
    assert voted <= declared, (
        f"{name} votes with undeclared or documenting rule ids {sorted(voted - declared)}"
    )
    assert voted, f"{name}: no fact in the grid makes any of its rules vote"
    # a rule marked as deciding that no fact makes vote is a documenting rule in disguise
    assert declared <= voted, (
        f"{name}: rules {sorted(declared - voted)} never vote: mark them documents=True"
    )


class _UndeclaredRulePlugin:
    """A plugin whose vote names a rule its table does not declare."""

    @hookimpl
    def gcpatch_plugin_info(self):
        return PluginInfo(
            name="undeclared",
            framework="pluggy",
            versions=">=0",
            rules=(Rule("U1", "u", "here"), Rule("U3", "documents only", "here", documents=True)),
        )

    @hookimpl
    def gcpatch_vote(self, facts):
        return [
            Vote(USE_REENTRANT, True, REQUIRED, "U1", "declared"),
            Vote(USE_REENTRANT, False, REQUIRED, "U2", "not"),
            Vote(INPUT_GRADS_HOOK, True, REQUIRED, "U3", "a documenting rule cannot decide"),
        ]


def test_a_vote_with_an_undeclared_rule_id_is_dropped_with_a_warning_and_refused_in_strict(caplog):
    host = PluginHost()
    host.add(_UndeclaredRulePlugin(), "undeclared")
    with caplog.at_level("WARNING", logger="gcpatch"):
        votes = host.votes(facts())
    assert [v.rule for v in votes] == ["U1"]
    assert "voted with rule 'U2', which its rule table does not declare" in caplog.text
    assert (
        "voted with rule 'U3', which its rule table does not declare as a voting rule"
        in caplog.text
    )
    strict = PluginHost(strict=True)
    strict.add(_UndeclaredRulePlugin(), "undeclared")
    with pytest.raises(GcpatchError, match="U2"):
        strict.votes(facts())


class _Lazy:
    """A module attribute that must not be read by registering (a lazy import proxy)."""

    def __getattr__(self, name):
        raise AssertionError(f"registering read {name!r} of a module attribute")


def test_a_plugin_module_registers_its_hooks_alone_and_they_vote():
    """pluggy is handed a plugin module's hook implementations (by the marker, whatever their
    names) and nothing else of it: it reads each name it is given, which cost about 0.15 ms per
    built-in plugin module at every process's first enable."""
    module = types.ModuleType("acme_plugin")

    @hookimpl
    def gcpatch_plugin_info():
        return PluginInfo(name="acme", framework="pluggy", versions=">=0", rules=(rule,))

    @hookimpl(specname="gcpatch_vote")
    def vote_on(facts):
        return [Vote(USE_REENTRANT, False, RECOMMENDED, "A1", "acme")]

    def helper():  # a plain function: not a hook
        return None

    rule = Rule("A1", "a", "here")
    module.gcpatch_plugin_info, module.vote_on, module.helper = gcpatch_plugin_info, vote_on, helper
    module.lazy, module.itertools = _Lazy(), itertools
    host = PluginHost()
    assert host.add(module, "acme").state == "active"
    assert sorted(dir(host._pm.get_plugin("acme"))) == ["gcpatch_plugin_info", "vote_on"]
    assert [(v.rule, v.plugin) for v in host.votes(facts())] == [("A1", "acme")]
