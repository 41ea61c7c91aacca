"""The budget's finer levers: a layer checkpointed keeping its matrix multiplies' outputs or its
attention output (gcpatch/step/selective.py), or run plain with its feed-forward block alone
checkpointed (gcpatch/step/feed_forward.py). On real tiny models with dropout (Llama, Mixtral, PEFT
LoRA): the gradients are those without checkpointing, each lever really fires, and the backward
recomputes what it says; a layer planned with one that does nothing falls back to whole
checkpointing, said once; their cost is measured on one layer called alone, from each mode's
recompute timed by itself and what else it adds to the step, where the clock can tell."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from gcpatch.budget import parse  # noqa: E402
from gcpatch.step import feed_forward, layer_costs, planner, selective, shapes  # noqa: E402
from gcpatch.step.cost_model import CostModel, Curve  # noqa: E402
from gcpatch.step.solver import FEED_FORWARD, KEEP_ATTENTION, KEEP_MATMULS  # noqa: E402


def _tiny(family: str, checkpointing: bool, layers: int = 2, **config):
    """A model of `family` (Llama, Mixtral), 2 layers, hidden 32, sdpa, non-reentrant when
    enabled."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        **config,
    )
    config._attn_implementation = "sdpa"
    model = getattr(transformers, f"{family}ForCausalLM")(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _llama(checkpointing: bool, dropout: float = 0.1):
    return _tiny("Llama", checkpointing, intermediate_size=64, attention_dropout=dropout)


def _step(model, ids, by_op: bool = False):
    torch.manual_seed(7)  # dropout draws the same masks in every run
    loss = model(input_ids=ids, labels=ids).loss
    counter = FlopCounterMode(display=False, custom_mapping=_attention_counted())
    with counter:
        loss.backward()
    flops = counter.get_total_flops()
    if by_op:
        flops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return {n: p.grad.clone() for n, p in model.named_parameters()}, flops


def _attention_counted():
    """torch's FLOP counter has formulas for the CUDA attention kernels only: CPU's fused kernel is
    counted with the same one, so a recompute of it shows."""
    from torch.utils import flop_counter

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query, key, value)

    return {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: forward}


def test_keeping_matmuls_is_exact_fires_and_recomputes_no_matmul():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain_grads, plain_flops = _step(_llama(False), ids)
    model = _llama(True)
    layers = list(model.model.layers)
    assert all(selective.available(m) for m in layers)
    policies = [selective.Keep(KEEP_MATMULS) for _ in layers]
    for layer, policy in zip(layers, policies):
        layer._gradient_checkpointing_func = selective.keeping(
            layer._gradient_checkpointing_func, policy
        )
    grads, flops = _step(model, ids)
    assert all(p.kept > 0 for p in policies)  # it fired in every layer
    assert all(torch.equal(grads[n], plain_grads[n]) for n in plain_grads)  # exact, dropout on
    assert flops == plain_flops  # matmuls kept: the backward recomputes none of them


def test_keeping_the_attention_output_is_exact_fires_and_recomputes_all_but_attention():
    """Without dropout CPU attention is one fused kernel: the lever keeps its output, so the
    backward recomputes every matmul a whole layer recomputes and not the kernel (checkpointing
    whole recomputes it, so this can fail)."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain_grads, plain = _step(_llama(False, dropout=0.0), ids, by_op=True)
    _, whole = _step(_llama(True, dropout=0.0), ids, by_op=True)
    model = _llama(True, dropout=0.0)
    policies = [selective.Keep(KEEP_ATTENTION) for _ in model.model.layers]
    for layer, policy in zip(model.model.layers, policies):
        layer._gradient_checkpointing_func = selective.keeping(
            layer._gradient_checkpointing_func, policy
        )
    grads, kept = _step(model, ids, by_op=True)
    assert all(p.kept > 0 for p in policies)  # it fired in every layer
    assert all(torch.equal(grads[n], plain_grads[n]) for n in plain_grads)
    kernel = "aten._scaled_dot_product_flash_attention_for_cpu"
    assert whole[kernel] > 0 and plain.get(kernel, 0) == 0  # whole recomputes the kernel
    assert kept.get(kernel, 0) == 0  # the lever does not
    assert kept["aten.mm"] == whole["aten.mm"] > plain["aten.mm"]  # and recomputes every matmul


def _mixtral(checkpointing: bool, jitter: float = 0.1):
    """A tiny MoE: 4 experts, 2 per token, attention dropout and router jitter (both random, drawn
    again in the recompute); transformers 5.x runs its experts as grouped matmuls."""
    return _tiny(
        "Mixtral",
        checkpointing,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        attention_dropout=0.1,
        router_jitter_noise=jitter,
    )


def _matmuls_in_backward(model, ids):
    """The gradients, and how many matmuls (experts' grouped ones included) the backward ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]  # mm, addmm, bmm, _grouped_mm, grouped_mm_fallback
            if name.removesuffix("_fallback").endswith("mm"):
                calls.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(7)
    loss = model(input_ids=ids, labels=ids).loss
    with Counting():
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, calls


def test_keeping_matmuls_in_moe_layers_keeps_the_experts_grouped_matmuls_and_is_exact():
    """An MoE layer's experts are most of its matmul work: keeping the matmuls keeps theirs too
    (transformers 5.x runs them as `aten._grouped_mm`, which a policy of mm/bmm alone missed: the
    backward recomputed every expert). Routed the same in the recompute: gradients exact."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain_grads, plain = _matmuls_in_backward(_mixtral(False), ids)
    _, whole = _matmuls_in_backward(_mixtral(True), ids)
    model = _mixtral(True)
    policies = [selective.Keep(KEEP_MATMULS) for _ in model.model.layers]
    for layer, policy in zip(model.model.layers, policies):
        layer._gradient_checkpointing_func = selective.keeping(
            layer._gradient_checkpointing_func, policy
        )
    grads, kept = _matmuls_in_backward(model, ids)
    assert all(p.kept > 0 for p in policies)
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[n], plain_grads[n]) for n in plain_grads)
    assert len(whole) > len(plain)  # whole checkpointing recomputes the experts, so this can fail
    assert sorted(kept) == sorted(plain)  # the lever recomputes no matmul, experts' included


def test_with_dropout_cpu_attention_is_unfused_and_the_attention_lever_keeps_nothing():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _llama(True)
    policy = selective.Keep(KEEP_ATTENTION)
    for layer in model.model.layers:
        layer._gradient_checkpointing_func = selective.keeping(
            layer._gradient_checkpointing_func, policy
        )
    grads, _ = _step(model, ids)
    assert policy.kept == 0  # so it is not offered (shares) and, planned, falls back (fired)


def test_a_reentrant_layer_or_a_users_own_context_fn_is_not_offered_the_lever():
    model = _llama(True)
    layer = model.model.layers[0]
    own = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, context_fn=id)
    layer._gradient_checkpointing_func = own
    assert not selective.available(layer)  # the user's selective checkpointing stands as given
    user = selective.not_offered([layer])
    layer._gradient_checkpointing_func = functools.partial(
        torch.utils.checkpoint.checkpoint, use_reentrant=True
    )
    assert not selective.available(layer)  # selective checkpointing needs non-reentrant
    reentrant = selective.not_offered([layer])
    assert selective.not_offered(list(model.model.layers)[1:]) is None  # the others offer it
    # what the budget's record says of the lever (`gcpatch explain`)
    shares = {KEEP_MATMULS: None, KEEP_ATTENTION: None}
    said = [planner._levers({"shares": shares, "not_offered": why}) for why in (user, reentrant)]
    assert said == [
        [
            "keeping the matmuls: not offered, the user's own context_fn stands as given",
            "keeping the attention output: not offered, the user's own context_fn stands as given",
        ],
        [
            f"{name}: not offered, reentrant checkpointing, which selective checkpointing cannot"
            " run under (use_reentrant=False offers it)"
            for name in ("keeping the matmuls", "keeping the attention output")
        ],
    ]
    measured = planner._levers(
        {"shares": {KEEP_MATMULS: 0.19, KEEP_ATTENTION: None}, "not_offered": None}
    )
    assert measured == [
        "keeping the matmuls: costs 0.19 of a whole layer's recompute (measured on one layer)",
        "keeping the attention output: not chosen, its cost could not be told on this clock (or"
        " its policy kept nothing)",
    ]
    # with the cost model's counted matmul FLOPs (the solver's tie-break) beside the seconds
    counted = planner._levers(
        {"shares": {KEEP_MATMULS: 0.19, KEEP_ATTENTION: None}, "not_offered": None},
        {KEEP_MATMULS: 0.0},
    )
    assert counted[0] == (
        "keeping the matmuls: costs 0.19 of a whole layer's recompute (measured on one layer),"
        " 0.00 of its matmul FLOPs (counted)"
    )


def _costs(layers: int) -> CostModel:
    """Every layer: 100 bytes plain, 10 whole, 40 keeping matmuls (60 of 100 s of recompute)."""
    flat = functools.partial(Curve, row_b=0.0, fixed_a=0.0, fixed_b=0.0, t_max=16.0)
    return CostModel(
        plain=[flat(row_a=100 / 16, row_at_max=100.0, fixed_at_max=0.0)] * layers,
        checkpointed=[flat(row_a=10 / 16, row_at_max=10.0, fixed_at_max=0.0)] * layers,
        outside=flat(row_a=0.0, row_at_max=0.0, fixed_at_max=0.0),
        seconds=[1.0] * layers,
        timed_at=(1, 16),
        kinds=["Layer"] * layers,
        matmul=[flat(row_a=30 / 16, row_at_max=30.0, fixed_at_max=0.0)] * layers,
        kept_seconds=[0.1] * layers,
    )


def test_a_layer_whose_policy_keeps_nothing_checkpoints_whole_from_the_next_step(caplog):
    model = _llama(True)
    layers = list(model.model.layers)
    plans = shapes.ShapePlans(model, layers, _costs(2), parse("0.45"), "LlamaForCausalLM")
    plans.policies[1][KEEP_MATMULS].ops = frozenset()  # it matches no op: it cannot fire
    first = plans.plan_for(1, 16)
    assert first.modes == ["keep-matmuls", "keep-matmuls"]
    plans.apply(first)
    plans.ran = True  # a training forward ran with it
    ids = torch.randint(0, 64, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    with caplog.at_level(logging.WARNING, logger="gcpatch"):
        plans.fired()
    [line] = [r.getMessage() for r in caplog.records if "saved nothing" in r.getMessage()]
    assert "keeping the matmuls saved nothing in layer(s) 1" in line, line
    again = plans.plan_for(1, 16)
    assert again.modes[1] != "keep-matmuls" and plans.misfired == {(1, KEEP_MATMULS)}
    plans.apply(again)
    assert "context_fn" not in layers[1]._gradient_checkpointing_func.keywords


class _WritesIntoItsOutput(transformers.models.llama.modeling_llama.LlamaMLP):
    """Adds to its down projection's output in place, as GPT-OSS's experts add their bias to the
    grouped matmul's (transformers/integrations/moe.py), and then takes an op that saves it (the
    recompute stops after the last saved tensor it needs: a write after it goes unseen)."""

    def forward(self, x):
        hidden = (self.act_fn(self.gate_proj(x)) * self.up_proj(x)).flatten(0, -2)
        out = torch.mm(hidden, self.down_proj.weight.t())  # 2-D, as the grouped matmul's
        return torch.nn.functional.silu(out.add_(1.0)).view_as(x)


def test_a_lever_a_layer_refuses_in_its_trial_is_left_out_on_that_build_alone():
    """Keeping the matmuls caches the down projection's output, which that MLP then changes:
    selective checkpointing refuses it in the backward. Tried once per build, the lever is left
    out on the layer built so, offered on the others, and said in the plan's line and explain."""
    model = _tiny("Llama", True, layers=3, intermediate_size=64)
    layers = list(model.model.layers)
    layers[1].mlp.__class__ = _WritesIntoItsOutput
    x = torch.randn(2, 16, 32, requires_grad=True)
    keep = selective.Keep(KEEP_MATMULS)
    func = selective.keeping(layers[1]._gradient_checkpointing_func, keep)
    mlp = layers[1].mlp
    with pytest.raises(RuntimeError, match="mutated"):  # the lever where it is not left out
        func(mlp, x).sum().backward()
    ids = torch.randint(0, 64, (2, 16))
    for layer in layers:
        layer.gradient_checkpointing = False
    measured = layer_costs.measure(
        model,
        layers,
        lambda rows, tokens: lambda: model(input_ids=ids[:rows]),
        (2, 16),
        ["LlamaDecoderLayer"] * 3,
    )
    refused = measured.refused
    assert list(refused) == [KEEP_MATMULS] and list(refused[KEEP_MATMULS]) == [1], refused
    assert "mutated" in refused[KEEP_MATMULS][1]
    kept = measured.model.kept_seconds
    assert kept[1] is None
    timed = measured.shares[KEEP_MATMULS] is not None
    assert [kept[i] is not None for i in (0, 2)] == [timed, timed]
    levers = {
        "shares": measured.shares,
        "not_offered": None,
        "refused": {KEEP_MATMULS: {"layers": [1], "why": refused[KEEP_MATMULS][1]}},
    }
    said = planner._levers(levers)[0]
    assert "keeping the matmuls: " in said and "mutated" in said, said
    line, short = planner._refused_text({"measured": {"levers": levers, "layers": [{}] * 3}})
    assert (line, short) == ("; keeping the matmuls refused on 1 of 3 layers", "; 1 lever refused")


# Samples of (step, its recompute alone) seconds `selective.shares` measured on one decoder layer
# of an 8-layer Llama, 2 rows, forward and backward, the first 5 rounds (milliseconds, process CPU
# time, two threads): hidden 256 x 1024 tokens, fused attention and attention dropout 0.1 (CPU sdpa
# then takes the math path, whose softmax and dropout over tokens x tokens a kept matmul does not
# spare); hidden 32 x 64 tokens on a 2-core machine busy with another training run.
FUSED = {
    "plain": [(413, 0), (419, 0), (460, 0), (397, 0), (434, 0)],
    "whole": [(532, 118), (532, 120), (556, 114), (514, 110), (536, 114)],
    "keep": [(483, 42), (491, 40), (485, 33), (477, 34), (469, 42)],
    "feed-forward": [(479, 56), (473, 46), (463, 60), (467, 49), (485, 55)],
}
MATH_DROPOUT = {
    "plain": [(991, 0), (1121, 0), (993, 0), (833, 0), (913, 0)],
    "whole": [(1860, 526), (1703, 519), (1381, 423), (1345, 396), (1405, 443)],
    "keep": [(1710, 413), (1492, 386), (1379, 340), (1309, 322), (1490, 359)],
}
TINY_LOADED = {
    "plain": [(12, 0), (12, 0), (12, 0), (12, 0), (8, 0)],
    "whole": [(22, 2), (24, 6), (24, 2), (24, 2), (87, 10)],
    "keep": [(44, 13), (37, 9), (25, 4), (156, 15), (38, 7)],
    "feed-forward": [(22, 1), (21, 1), (23, 1), (13, 9), (13, 1)],
}


def _seconds(samples):
    return {
        mode: [selective.Timed(total / 1000, recompute / 1000) for total, recompute in times]
        for mode, times in samples.items()
    }


def test_the_share_is_the_modes_recompute_and_what_else_it_adds_where_the_clock_can_tell():
    share = selective._share
    # keeping the matmuls: its fastest recompute, 33 ms, and the median of its rest less plain's
    # round by round (441-413, 451-419, 452-460, 443-397, 427-434: 28 ms, its policy's calls in
    # the forward); whole: 110 ms, its rest below plain's (a median of -7 ms) counts as none
    assert share(_seconds(FUSED), "keep") == pytest.approx((33 + 28) / 110)
    # the feed-forward block alone: 46 ms recomputed and 8 ms more of the rest (10, 8, -57, 21,
    # -4). Where such a lever's step measured at or below plain's, the difference of the two
    # fastest steps said it cost nothing, and the solver checkpointed the block everywhere
    assert share(_seconds(FUSED), "feed-forward") == pytest.approx((46 + 8) / 110)
    # with dropout, keeping recomputes softmax and dropout over tokens x tokens: 322 ms of whole's
    # 396, and its rest 154 ms over plain's (306, -15, 46, 154, 218) against whole's 63
    assert share(_seconds(MATH_DROPOUT), "keep") == pytest.approx((322 + 154) / (396 + 63))
    # a loaded machine: keeping's two fastest recomputes 3 ms apart (4 and 7) against whole's
    # fastest of 2 ms: no lever is chosen by that clock
    assert share(_seconds(TINY_LOADED), "keep") is None


def test_each_mode_times_its_recompute_alone_whatever_calls_the_checkpoint():
    """transformers 5.x checkpoints a layer's `forward` inside its call, so the layer's own hooks
    see one call with or without checkpointing (4.x checkpoints its `__call__`): the recompute is
    timed around the function the checkpoint is handed. Plain has none; every other mode one, as
    long as the step's own or shorter."""
    model = _llama(checkpointing=True)
    layers = list(model.model.layers)
    for layer in layers:
        layer.gradient_checkpointing = False
    ids = torch.randint(0, 64, (2, 16))
    [call] = selective._calls(torch, layers, lambda: model(input_ids=ids), {0}).values()
    trial = selective._Trial(torch, layers[0], call, True, False, time.process_time)
    assert set(trial.modes) == {"plain", "whole", KEEP_MATMULS, KEEP_ATTENTION, FEED_FORWARD}
    for mode in trial.modes:
        timed = trial.step(mode)
        if mode == "plain":
            assert timed.recompute == 0.0, timed
        else:
            assert 0.0 < timed.recompute < timed.total, (mode, timed)
    assert all(p.grad is None for p in model.parameters())


def test_the_share_is_measured_on_one_layer_called_alone_and_touches_no_grad():
    """Also under a host's FLOP counter around the step, whose module tracker hooks every
    layer's inputs: autograd.grad refuses those hooks on a leaf, so the layer's input is not one."""
    model = _llama(checkpointing=True)
    layers = list(model.model.layers)
    for layer in layers:
        layer.gradient_checkpointing = False  # the measuring forward runs every layer plain
    ids = torch.randint(0, 64, (2, 16))
    calls = []
    handle = layers[0].register_forward_pre_hook(
        lambda m, a: calls.append(m.gradient_checkpointing)
    )
    with FlopCounterMode(display=False):
        shares = selective.shares(layers, lambda: model(input_ids=ids))
    handle.remove()
    # the capturing forward, the warm-up round (plain, whole, each lever, the feed-forward block
    # alone), then the measured rounds without the attention lever: with dropout CPU attention is
    # unfused, there is no kernel to keep, and a lever that kept nothing is not timed
    rounds = (len(calls) - 6) // 4
    assert selective.ROUNDS <= rounds <= selective.MAX_ROUNDS
    assert calls == [False] + [False, True, True, True, True] + [False, True, True, True] * rounds
    assert shares[KEEP_MATMULS] is None or shares[KEEP_MATMULS] >= 0.0
    assert shares[FEED_FORWARD] is None or shares[FEED_FORWARD] >= 0.0
    assert shares[KEEP_ATTENTION] is None
    assert all(p.grad is None for p in model.parameters())
    assert all(vars(m).get("gradient_checkpointing") is False for m in layers)
    assert "context_fn" not in layers[0]._gradient_checkpointing_func.keywords


def test_each_lever_counts_what_it_recomputes_of_a_whole_layers_matmul_flops():
    """The solver breaks ties its clock cannot tell by these counts (gcpatch/step/solver.py
    `SLACK`), taken on one layer: they are what each lever recomputes on the whole model, over what
    checkpointing every layer whole recomputes, counted here by torch's FLOP counter around the
    model's backward (fused CPU attention: keeping the matmuls recomputes none, keeping the
    attention output all but the kernel, the MLP alone its gate and up projections)."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    _, plain = _step(_llama(False, dropout=0.0), ids)
    _, whole = _step(_llama(True, dropout=0.0), ids)

    def recomputed(lever):
        model = _llama(True, dropout=0.0)
        if lever == FEED_FORWARD:
            _split(model)
        else:
            for layer in model.model.layers:
                func = layer._gradient_checkpointing_func
                layer._gradient_checkpointing_func = selective.keeping(func, selective.Keep(lever))
        return (_step(model, ids)[1] - plain) / (whole - plain)

    model = _llama(True, dropout=0.0)
    layers = list(model.model.layers)
    for layer in layers:
        layer.gradient_checkpointing = False
    counted: dict = {}
    selective.shares(layers, lambda: model(input_ids=ids), matmuls=counted)
    assert set(counted) == {KEEP_MATMULS, KEEP_ATTENTION, FEED_FORWARD}, counted
    assert counted[KEEP_MATMULS] == 0.0
    assert 0.0 < counted[FEED_FORWARD] < counted[KEEP_ATTENTION] < 1.0
    for lever, share in counted.items():
        assert share == pytest.approx(recomputed(lever), abs=1e-9), lever
    # the counts travel with the cost model (a record, a copy of the model) into the solver
    costs = CostModel.from_dict(dataclasses.replace(_costs(2), matmul_shares=counted).to_dict())
    [layer, _], _ = costs.layers(1, 16)
    assert layer.redone(KEEP_MATMULS) == 0.0 and layer.redone("full") == layer.seconds
    assert layer.redone(FEED_FORWARD) == counted[FEED_FORWARD] * layer.seconds


def test_a_count_that_fails_leaves_the_ties_to_the_seconds_in_one_line(monkeypatch, caplog):
    """The count is the solver's tie-break, never the measuring's failure: a counter that raises
    (a kernel without a formula in some torch) leaves no counts, said once, and the shares stand."""

    class Raising:
        def __enter__(self):
            raise RuntimeError("no formula")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(selective.flops, "counter", Raising)
    model = _llama(True, dropout=0.0)
    layers = list(model.model.layers)
    for layer in layers:
        layer.gradient_checkpointing = False
    ids = torch.randint(0, 64, (2, 16))
    counted: dict = {}
    with caplog.at_level(logging.WARNING, logger="gcpatch"):
        shares = selective.shares(layers, lambda: model(input_ids=ids), matmuls=counted)
    assert counted == {}
    lines = [r.getMessage() for r in caplog.records if "FLOPs failed" in r.getMessage()]
    assert lines == [
        "gcpatch: counting the levers' FLOPs failed (RuntimeError: no formula); the budget breaks"
        " its ties by their seconds"
    ]
    assert set(shares) >= {KEEP_MATMULS, KEEP_ATTENTION}


def test_a_layer_given_the_forwards_cache_is_measured_without_it():
    """A model left with use_cache on hands each layer the forward's key/value cache: a layer
    called again would append to it, carrying one call's graph into the next backward."""
    model = _llama(checkpointing=True)
    layers = list(model.model.layers)
    for layer in layers:
        layer.gradient_checkpointing = False
    ids = torch.randint(0, 64, (2, 16))
    shares = selective.shares(layers, lambda: model(input_ids=ids, use_cache=True))
    assert all(share is None or share >= 0.0 for share in shares.values())
    assert all(p.grad is None for p in model.parameters())


# The lever without a policy (gcpatch/step/feed_forward.py): a layer run plain, its MLP alone
# checkpointed.


def _split(model) -> list:
    """Every layer planned with its feed-forward block alone checkpointed; the wrappers."""
    wrappers = []
    for layer in model.model.layers:
        assert selective.splittable(layer)
        wrappers.append(
            feed_forward.FeedForward(layer._gradient_checkpointing_func, feed_forward.block(layer))
        )
        layer._gradient_checkpointing_func = wrappers[-1]
    return wrappers


def test_checkpointing_the_mlp_alone_is_exact_fires_and_recomputes_only_its_gate_and_up():
    """With dropout the gradients are those without checkpointing, bit for bit; without it (CPU
    attention one fused kernel) the backward recomputes exactly the MLP's gate and up projections
    in each layer (its down projection's output is not needed: torch's early stop) and no
    attention, where checkpointing whole recomputes the kernel and every projection."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain_grads, _ = _step(_llama(False), ids)
    model = _llama(True)
    wrappers = _split(model)
    grads, _ = _step(model, ids)
    assert [w.ran for w in wrappers] == [1, 1]  # one checkpointed call per layer and forward
    assert all(torch.equal(grads[n], plain_grads[n]) for n in plain_grads)
    _, plain = _step(_llama(False, dropout=0.0), ids, by_op=True)
    _, whole = _step(_llama(True, dropout=0.0), ids, by_op=True)
    model = _llama(True, dropout=0.0)
    _split(model)
    _, split = _step(model, ids, by_op=True)
    tokens, hidden, inner, layers = 2 * 16, 32, 64, 2
    gate_and_up = layers * 2 * (2 * tokens * hidden * inner)
    assert split["aten.mm"] == plain["aten.mm"] + gate_and_up < whole["aten.mm"]
    kernel = "aten._scaled_dot_product_flash_attention_for_cpu"
    assert whole[kernel] > 0 and split.get(kernel, 0) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_alones_figure_is_what_every_mix_with_it_holds(dtype):
    """One plain forward gives each layer's figure with its MLP alone checkpointed (plain less
    what the block made and keeps, gcpatch/step/held.py `Held.feed_forward_shed`): every mix of
    plain, whole and that lever over 3 layers holds the sum of its figures, exactly where no
    layer is whole (whole misses the 128-byte position ids every layer takes, as before)."""
    from gcpatch.step.held import OUTSIDE, Held, held_bytes

    model = _tiny("Llama", True, layers=3, intermediate_size=64, attention_dropout=0.1).to(dtype)
    layers = list(model.model.layers)
    own = layers[0]._gradient_checkpointing_func
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for layer in layers:
        layer.gradient_checkpointing = False
    held = Held(layers, savers=True, blocks=[feed_forward.block(m) for m in layers])
    with held:
        output = model(input_ids=ids, labels=ids)
    alive = held.alive(output.logits)
    figures = [
        {
            "P": alive[i],
            "W": held.checkpointed(i),
            "F": alive[i] - held.feed_forward_shed(i),
        }
        for i in range(3)
    ]
    del output, held
    assert all(f["W"] < f["F"] < f["P"] for f in figures), figures
    for mix in itertools.product("PWF", repeat=3):
        for layer, mode in zip(layers, mix):
            layer.gradient_checkpointing = mode != "P"
            layer._gradient_checkpointing_func = (
                feed_forward.FeedForward(own, layer.mlp) if mode == "F" else own
            )
        with held_bytes() as counted:
            output = model(input_ids=ids, labels=ids)
        total = counted.total(output.logits)
        expected = alive.get(OUTSIDE, 0) + sum(f[mode] for f, mode in zip(figures, mix))
        assert total - expected == (128 if "W" in mix else 0), (mix, total, expected)
        output.loss.backward()
        model.zero_grad(set_to_none=True)


def test_checkpointing_the_moe_block_alone_is_exact_and_not_offered_where_it_writes_its_input():
    """Mixtral's sparse MoE block is its feed-forward block: with attention dropout (drawn again
    in the recompute), checkpointed alone, exact. Its router jitter multiplies the block's input
    in place: checkpointed alone, that saved input would have changed by the recompute (autograd
    refuses it in the backward), so the measuring forward that sees the write does not offer it
    (gcpatch/step/held.py)."""
    from gcpatch.step.held import Held

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain_grads, plain = _matmuls_in_backward(_mixtral(False, jitter=0.0), ids)
    model = _mixtral(True, jitter=0.0)
    wrappers = _split(model)
    grads, split = _matmuls_in_backward(model, ids)
    assert all(w.ran == 1 for w in wrappers)
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[n], plain_grads[n]) for n in plain_grads)
    assert len(split) > len(plain)  # the experts ran again in the backward
    for jitter, offered in ((0.0, True), (0.1, False)):
        model = _mixtral(False, jitter=jitter)
        layers = list(model.model.layers)
        held = Held(layers, blocks=[feed_forward.block(m) for m in layers])
        with held:
            model(input_ids=ids, labels=ids)
        assert [held.feed_forward_shed(i) is not None for i in range(2)] == [offered] * 2
    model = _mixtral(True, jitter=0.1)
    _split(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _matmuls_in_backward(model, ids)  # what not offering it spares the job


def test_checkpointing_the_mlp_alone_under_peft_lora_is_exact():
    """LoRA on the MLP's projections, with LoRA dropout (drawn again in the recompute)."""
    peft = pytest.importorskip("peft")

    def lora(checkpointing):
        model = peft.get_peft_model(
            _llama(checkpointing),
            peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj"], lora_dropout=0.1),
        )
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param)  # B starts at zero: no gradient reaches A
        return model

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    plain = lora(False)
    torch.manual_seed(5)
    model = lora(True)
    wrappers = _split(model.base_model.model)

    def grads(m):
        torch.manual_seed(7)
        m(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    expected, got = grads(plain), grads(model)
    assert all(w.ran == 1 for w in wrappers) and len(got) == 8  # A and B, 2 modules, 2 layers
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_the_recompute_calls_the_block_through_its_hooks_and_another_tools_forward_stays():
    """The recompute goes through the block's `__call__`, as a whole layer's does (a ZeRO-3 block
    gathers its parameters in a pre-hook); a `forward` another tool set on the block (accelerate's
    hooks) is the one checkpointed, and is back afterwards."""
    model = _llama(True)
    _split(model)
    block = model.model.layers[0].mlp
    calls, theirs = [], block.forward

    def tools_forward(*args, **kwargs):
        calls.append("forward")
        return theirs(*args, **kwargs)

    block.forward = tools_forward
    block.register_forward_pre_hook(lambda module, args: calls.append("pre-hook"))
    ids = torch.randint(0, 64, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    assert calls == ["pre-hook", "forward"] and vars(block)["forward"] is tools_forward
    loss.backward()
    assert calls == ["pre-hook", "forward"] * 2  # the recompute, through the hook
    del vars(block)["forward"]
    model(input_ids=ids, labels=ids).loss.backward()
    assert "forward" not in vars(block)  # none set: none left behind


def test_the_mlp_alone_is_offered_where_the_selective_levers_are_and_a_block_is():
    model = _llama(True)
    layer = model.model.layers[0]
    assert feed_forward.block(layer) is layer.mlp and selective.splittable(layer)
    for own in (
        functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, context_fn=id),
        functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True),
    ):
        layer._gradient_checkpointing_func = own
        assert not selective.splittable(layer)  # a user's context_fn; reentrant
    opt = _tiny_opt()
    assert all(feed_forward.block(m) is None for m in opt.model.decoder.layers)  # fc1, fc2 inline
    assert not any(selective.splittable(m) for m in opt.model.decoder.layers)


def _tiny_opt():
    config = transformers.OPTConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4
    )
    model = transformers.OPTForCausalLM(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def test_a_layer_that_never_calls_its_block_checkpoints_whole_from_the_next_step(caplog):
    flat = functools.partial(Curve, row_b=0.0, fixed_a=0.0, fixed_b=0.0, t_max=16.0)
    costs = _costs(2)
    # 50 of 100 bytes held with the block alone checkpointed, for 5 of 100 s of recompute
    costs.feed_forward = [flat(row_a=50 / 16, row_at_max=50.0, fixed_at_max=0.0)] * 2
    costs.feed_forward_seconds = [0.05] * 2
    costs.kept_seconds = None  # keeping the matmuls not offered: it would be the plan
    model = _llama(True)
    layers = list(model.model.layers)
    plans = shapes.ShapePlans(model, layers, costs, parse("0.5"), "LlamaForCausalLM")
    plans.lever_funcs[1][FEED_FORWARD].block = torch.nn.Linear(1, 1)  # a block never called
    first = plans.plan_for(1, 16)
    assert first.modes == ["feed-forward", "feed-forward"]
    plans.apply(first)
    plans.ran = True
    ids = torch.randint(0, 64, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    with caplog.at_level(logging.WARNING, logger="gcpatch"):
        plans.fired()
    [line] = [r.getMessage() for r in caplog.records if "block alone" in r.getMessage()]
    assert (
        "checkpointing the feed-forward block alone saw no call of the block in layer(s) 1;"
        " they checkpoint whole from the next step" in line
    ), line
    again = plans.plan_for(1, 16)
    assert again.modes[0] == "feed-forward" and again.modes[1] != "feed-forward"
    assert plans.misfired == {(1, FEED_FORWARD)}
    plans.apply(again)
    assert not isinstance(layers[1]._gradient_checkpointing_func, feed_forward.FeedForward)
    explained = planner._levers(
        {"shares": {KEEP_MATMULS: 0.19, FEED_FORWARD: None}, "not_offered": None}
    )
    assert explained[1] == (
        "checkpointing the feed-forward block alone: not chosen, its cost could not be told on"
        " this clock (or it saw no call of the block)"
    )


# families and the name of their feed-forward block; the config keywords each needs at hidden 32
FAMILIES = {
    "Qwen2": ({}, "Qwen2MLP"),
    "Gemma2": ({"head_dim": 8}, "Gemma2MLP"),
    "Phi3": ({"pad_token_id": 0}, "Phi3MLP"),
    "GPTNeoX": ({}, "GPTNeoXMLP"),
    "Falcon": ({}, "FalconMLP"),
    "Qwen2Moe": (
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        "Qwen2MoeSparseMoeBlock",
    ),
    "GPT2": ({"n_embd": 32, "n_layer": 2, "n_head": 4}, "GPT2MLP"),
}


def _family(family: str, checkpointing: bool):
    """A tiny 2-layer model of `family` with every dropout its config has at 0.1."""
    extra, _ = FAMILIES[family]
    torch.manual_seed(0)
    shape = {"vocab_size": 64, "use_cache": False}
    if family != "GPT2":
        shape.update(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
        )
    config = getattr(transformers, f"{family}Config")(**shape, **extra)
    for name in ("attention_dropout", "attn_pdrop", "hidden_dropout", "resid_pdrop"):
        if hasattr(config, name):
            setattr(config, name, 0.1)
    head = getattr(transformers, f"{family}ForCausalLM", None)
    model = (head or getattr(transformers, f"{family}LMHeadModel"))(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _decoder_layers(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_mlp_alone_is_found_measured_and_exact_across_families(family):
    """The block by its name in each family (GPT-2's MLP carries its own residual dropout, drawn
    again in the recompute); the measuring forward sees each block's bytes."""
    from gcpatch.step.held import Held

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def grads(model):
        torch.manual_seed(7)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    expected = grads(_family(family, False))
    model = _family(family, True)
    layers = _decoder_layers(model)
    assert [type(feed_forward.block(m)).__name__ for m in layers] == [FAMILIES[family][1]] * 2
    wrappers = []
    for layer in layers:
        assert selective.splittable(layer)
        wrappers.append(
            feed_forward.FeedForward(layer._gradient_checkpointing_func, feed_forward.block(layer))
        )
        layer._gradient_checkpointing_func = wrappers[-1]
    got = grads(model)
    assert [w.ran for w in wrappers] == [1, 1]
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    plain = _family(family, False)
    layers = _decoder_layers(plain)
    held = Held(layers, blocks=[feed_forward.block(m) for m in layers])
    with held:
        output = plain(input_ids=ids, labels=ids)  # its graph holds what the backward needs
    assert all(held.feed_forward_shed(i) > 0 for i in range(2)), output.loss


def test_explain_gives_each_layers_bytes_with_its_feed_forward_block_alone():
    """`gcpatch explain` reads the measured figures from the record: per layer, what it holds
    plain, whole, and with its block alone checkpointed where it has one."""
    layer = {"plain_bytes": 100 * 2**20, "checkpointed_bytes": 8 * 2**20, "recompute_s": 0.02}
    outcome = {
        "flags": [True, True],
        "measured": {
            "rows": [1, 2],
            "tokens": [512, 1024],
            "batch": 2,
            "seconds": 1.5,
            "outside_bytes": 2**20,
            "levers": {"shares": {KEEP_MATMULS: 0.2, FEED_FORWARD: 0.18}, "not_offered": None},
            "layers": [{**layer, "feed_forward_bytes": 47 * 2**20}, layer],
        },
    }
    lines = planner._details(outcome)
    assert lines[2] == (
        "checkpointing the feed-forward block alone: costs 0.18 of a whole layer's recompute"
        " (measured on one layer)"
    )
    assert lines[3] == (
        "layer 0: checkpointed; holds 100 MiB plain, 8 MiB checkpointed, 47 MiB with its"
        " feed-forward block alone; recompute 20 ms"
    )
    assert "feed-forward" not in lines[4]


def test_whole_layers_alone_when_the_user_asks_and_a_bad_value_is_said(monkeypatch, capsys):
    """GCPATCH_BUDGET_LEVERS=whole: no lever measured or offered (plans of whole layers, the same
    on every run); `all` is the default; any other value is said once and taken as `all`."""
    from gcpatch import settings
    from gcpatch.step import layer_costs

    model = _llama(True, dropout=0.0)
    layers = list(model.model.layers)
    for layer in layers:
        layer.gradient_checkpointing = False
    ids = torch.randint(0, 64, (2, 16))

    def run(rows, tokens):
        return lambda: model(input_ids=ids[:rows, :tokens], labels=ids[:rows, :tokens])

    kinds = ["LlamaDecoderLayer"] * 2
    whole = layer_costs.measure(model, layers, run, (2, 16), kinds, levers=False)
    assert whole.shares == {KEEP_MATMULS: None, KEEP_ATTENTION: None}
    assert whole.not_offered == layer_costs.WHOLE_ASKED
    assert all(c.kept is None and c.attention is None for c in whole.layers)
    assert all(c.feed_forward is None and c.offloaded is None for c in whole.layers)
    every = layer_costs.measure(model, layers, run, (2, 16), kinds)
    assert FEED_FORWARD in every.shares and every.not_offered is None
    for raw, expected in ((None, True), ("whole", False), (" ALL ", True), ("halves", True)):
        if raw is None:
            monkeypatch.delenv("GCPATCH_BUDGET_LEVERS", raising=False)
        else:
            monkeypatch.setenv("GCPATCH_BUDGET_LEVERS", raw)
        assert settings.budget_levers() is expected
    said = [line for line in capsys.readouterr().err.splitlines() if "BUDGET_LEVERS" in line]
    assert said == [
        "gcpatch: GCPATCH_BUDGET_LEVERS='halves' is neither all nor whole; every lever, as with all"
    ]
