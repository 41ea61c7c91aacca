"""The budget's levers between plain and whole (gcpatch/step/levers/), on real tiny models with
dropout: exact, firing, recomputing what they say; offered by the probed first step
(gcpatch/step/probe.py) only where they can run, its figures what a forward in any mix of modes
holds and recomputes; a lever that did nothing gives way to whole from the next step."""

from __future__ import annotations

import functools
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from gcpatch import headline, settings  # noqa: E402
from gcpatch.budget import parse  # noqa: E402
from gcpatch.step import cost_model, first_step, levers, plan_lines, shapes, solver  # noqa: E402
from gcpatch.step.held import held_bytes  # noqa: E402
from gcpatch.step.levers import feed_forward, keep_attention, keep_matmuls  # noqa: E402
from gcpatch.step.levers.policy import policy_of  # noqa: E402
from gcpatch.step.outcome import Outcome  # noqa: E402
from gcpatch.step.probe import ATTENTION, BLOCK, MATMUL, Probe  # noqa: E402
from gcpatch.step.solver import PLAIN  # noqa: E402

WHOLE = levers.WHOLE.name
KEEP_MATMULS, KEEP_ATTENTION, FEED_FORWARD = (
    lever.LEVER.name for lever in (keep_matmuls, keep_attention, feed_forward)
)
IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
KERNEL = "aten._scaled_dot_product_flash_attention_for_cpu"  # CPU's fused attention
GROUPED = "aten._grouped_mm"  # the MoE experts' matmuls (transformers 5.x)


DROPOUTS = ("attention_dropout", "attn_pdrop", "hidden_dropout", "resid_pdrop", "embd_pdrop")


def _tiny(family: str, checkpointing: bool, layers=2, reentrant=False, dropout=0.1, **config):
    """A model of `family`: hidden 32, sdpa, every dropout its config has at `dropout`, every
    layer checkpointed whole where enabled."""
    torch.manual_seed(0)
    if family == "GPT2":
        config.update(n_embd=32, n_layer=layers, n_head=4)
    else:
        config = {"intermediate_size": 64, "num_key_value_heads": 2, **config}
        config.update(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4)
    config = getattr(transformers, f"{family}Config")(vocab_size=64, use_cache=False, **config)
    for name in DROPOUTS:
        if hasattr(config, name):
            setattr(config, name, dropout)
    if family in ("Llama", "Mixtral"):
        config._attn_implementation = "sdpa"  # fused on a CPU without dropout
    head = getattr(transformers, f"{family}ForCausalLM", None)
    model = (head or getattr(transformers, f"{family}LMHeadModel"))(config).train()
    if checkpointing:
        kwargs = {"use_reentrant": reentrant}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def _llama(checkpointing: bool, dropout: float = 0.1, layers: int = 2, **config):
    return _tiny("Llama", checkpointing, layers, dropout=dropout, **config)


def _mixtral(checkpointing: bool, jitter: float = 0.0):
    """4 experts, 2 a token (transformers 5.x: grouped matmuls); jitter writes the block's input."""
    experts = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48}
    return _tiny("Mixtral", checkpointing, router_jitter_noise=jitter, **experts)


def _decoder_layers(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _probed(model, ids=IDS, accelerator: bool = False):
    """The model's first training step (every layer checkpointed), probed as the budget probes
    it, and the cost model built from it: (facts, cost model)."""
    layers = _decoder_layers(model)
    probe = Probe(layers, [feed_forward.block(m) for m in layers], tuple(ids.shape), accelerator)
    probe.start()
    try:
        loss = model(input_ids=ids, labels=ids).loss
        probe.forward_done()
        loss.backward()
    finally:
        facts = probe.finish()
    model.zero_grad(set_to_none=True)
    funcs = [m._gradient_checkpointing_func for m in layers]
    return facts, cost_model.build(facts, layers, funcs)


def _wrap(model, name: str, only=None) -> list:
    """Every layer (or layer `only`) run under lever `name`; the wrapped functions."""
    lever, out = levers.get(name), []
    for i, layer in enumerate(_decoder_layers(model)):
        if only is None or i == only:
            out.append(lever.wrap(layer._gradient_checkpointing_func, layer))
            layer._gradient_checkpointing_func = out[-1]
    return out


def _grads(model, ids=IDS, counter=None):
    """A training step's gradients (the same dropout masks every run), and its backward's FLOPs
    by operator under `counter`."""
    torch.manual_seed(7)
    loss = model(input_ids=ids, labels=ids).loss
    counter = counter or FlopCounterMode(display=False)
    with counter:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


def _counted():
    """torch's FLOP counter with formulas for CPU's fused attention (CUDA's kernels' formula) and
    the experts' grouped matmuls, which torch counts none of: their recompute shows."""
    from torch.utils import flop_counter

    def attention(query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query, key, value)

    def grouped(a, b, *args, out_shape=None, **kwargs):
        return 2 * out_shape[0] * out_shape[1] * a[-1]

    aten = torch.ops.aten
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: attention}
    return FlopCounterMode(display=False, custom_mapping={**mapping, aten._grouped_mm: grouped})


def _same(got: dict, expected: dict) -> bool:
    return got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)


@pytest.mark.parametrize("name, dropout", [(KEEP_MATMULS, 0.1), (KEEP_ATTENTION, 0.0)])
def test_keeping_is_exact_fires_and_recomputes_only_what_it_does_not_keep(name, dropout):
    """Keeping the matmuls (dropout on: CPU attention unfused), the backward recomputes none;
    keeping the attention output (no dropout: one fused kernel), every matmul whole recomputes
    but not the kernel. Both exact, both fire in every layer."""
    plain_grads, plain = _grads(_llama(False, dropout), counter=_counted())
    _, whole = _grads(_llama(True, dropout), counter=_counted())
    assert whole["aten.mm"] > plain["aten.mm"]  # checkpointing whole recomputes them: can fail
    model = _llama(True, dropout)
    wrapped = _wrap(model, name)
    grads, kept = _grads(model, counter=_counted())
    assert all(policy_of(w).kept > 0 and levers.get(name).fired(w) for w in wrapped)
    assert _same(grads, plain_grads)
    if name == KEEP_MATMULS:
        assert kept == plain  # no matmul recomputed
    else:
        assert whole[KERNEL] > 0 and KERNEL not in plain and KERNEL not in kept
        assert kept["aten.mm"] == whole["aten.mm"]


def test_keeping_matmuls_in_moe_layers_keeps_the_experts_grouped_matmuls_and_is_exact():
    """An MoE layer's experts are most of its matmul work: keeping the matmuls keeps their
    grouped matmuls too. Routed the same in the recompute: the gradients are exact."""
    plain_grads, plain = _grads(_mixtral(False), counter=_counted())
    _, whole = _grads(_mixtral(True), counter=_counted())
    model = _mixtral(True)
    wrapped = _wrap(model, KEEP_MATMULS)
    grads, kept = _grads(model, counter=_counted())
    assert all(policy_of(w).kept > 0 for w in wrapped) and _same(grads, plain_grads)
    assert whole[GROUPED] > plain[GROUPED]  # whole recomputes the experts: can fail
    assert kept == plain  # the lever recomputes no matmul, the experts' included


def test_with_dropout_cpu_attention_is_unfused_and_keeping_it_is_not_offered():
    """With attention dropout CPU attention runs as matmuls, softmax and dropout: the probed step
    saw no attention kernel, so keeping its output is not offered (run anyway, it keeps
    nothing); without dropout it is."""
    facts, costs = _probed(_llama(True, dropout=0.1))
    assert all(
        ATTENTION not in layer.kept and layer.kept[MATMUL].total > 0 for layer in facts.layers
    )
    for layer in costs.layers:
        assert layer.refused[KEEP_ATTENTION] == "the layer runs none of the operators it keeps"
        assert KEEP_ATTENTION not in layer.held and KEEP_MATMULS in layer.held
    model = _llama(True, dropout=0.1)
    wrapped = _wrap(model, KEEP_ATTENTION)
    _grads(model)
    assert not any(levers.get(KEEP_ATTENTION).fired(w) for w in wrapped)
    _, fused = _probed(_llama(True, dropout=0.0))
    assert all(KEEP_ATTENTION in layer.held for layer in fused.layers)


def test_a_reentrant_layer_or_a_users_own_context_fn_is_offered_whole_alone():
    """Selective checkpointing needs non-reentrant checkpointing, and a user's own context_fn
    (their own selective checkpointing) stands as given: the probed step offers those layers no
    lever, the others every one, and the record's details say why."""
    facts, costs = _probed(_llama(True, reentrant=True))
    assert facts.complete  # reentrant: the layers' saves were read in the recompute
    reentrant = (
        "reentrant checkpointing, which selective checkpointing cannot run under"
        " (use_reentrant=False offers it)"
    )
    for layer in costs.layers:
        assert set(layer.held) == {PLAIN, WHOLE}, layer.held
        assert all(layer.refused[n] == reentrant for n in (KEEP_MATMULS, FEED_FORWARD))
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def users(ctx, func, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    model = _llama(True, dropout=0.0)
    model.model.layers[0]._gradient_checkpointing_func = functools.partial(
        torch.utils.checkpoint.checkpoint,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, users),
    )
    _, costs = _probed(model)
    first, second = costs.layers
    theirs = "the user's own context_fn stands as given"
    assert set(first.held) == {PLAIN, WHOLE}
    assert all(first.refused[n] == theirs for n in (KEEP_MATMULS, KEEP_ATTENTION, FEED_FORWARD))
    assert {KEEP_MATMULS, KEEP_ATTENTION, FEED_FORWARD} <= set(second.held)
    details = plan_lines.details(Outcome(costs=costs))
    assert f"{KEEP_MATMULS}: {theirs}" in details[1] and theirs not in details[2]


def _planned(model, costs, name: str):
    """Plans over the probed cost model where `name` is the one lever (its cost fixed below whole's,
    so the plan is the same on every clock), at a budget every layer under it meets."""
    for layer in costs.layers:
        for other in list(layer.held):
            if other not in (PLAIN, WHOLE, name):
                costs.drop(costs.layers.index(layer), other, "not in this test")
        layer.shares, layer.seconds = {WHOLE: 1.0, name: 0.1}, 1.0
    at, outside, _ = costs.at(*IDS.shape)
    limit = outside + costs.calls_at(*IDS.shape) + sum(layer.held(name) for layer in at)
    plans = shapes.ShapePlans(model, _decoder_layers(model), costs, parse(f"{int(limit)}B"), "m")
    first = plans.plan_for(*IDS.shape)
    assert first.modes == [name] * len(at), first.modes
    return plans, first


@pytest.mark.parametrize(
    "name, said",
    [
        (KEEP_MATMULS, "keeping the matmuls saved nothing"),
        (FEED_FORWARD, "checkpointing the feed-forward block alone saw no call of the block"),
    ],
)
def test_a_layer_whose_lever_did_nothing_checkpoints_whole_from_the_next_step(name, said, caplog):
    """A policy that kept nothing, a block never called: said once at the next training forward,
    the lever dropped there from the cost model, and a plan naming it runs the own function."""
    model = _llama(True)
    _, costs = _probed(model)
    plans, first = _planned(model, costs, name)
    if name == KEEP_MATMULS:
        policy_of(plans.lever_funcs[1][name]).ops = frozenset()  # it cannot fire
    else:
        plans.lever_funcs[1][name].block = torch.nn.Linear(1, 1)  # a block never called
    plans.apply(first)
    plans.ran = True  # a training forward ran with it
    model(input_ids=IDS, labels=IDS).loss.backward()
    with caplog.at_level(logging.WARNING, logger="gcpatch"):
        plans.fired()
        plans.fired()
    [line] = [
        headline.unwrap(r.getMessage()) for r in caplog.records if " budget " in r.getMessage()
    ]
    assert f"{said} in layer(s) 1; they checkpoint whole from the next step" in line, line
    assert plans.misfired == {(1, name)} and costs.layers[1].refused[name] == f"{said} in a step"
    assert plans.plan_for(*IDS.shape).modes[1] != name
    plans.apply(first)  # a plan naming it still: the layer's own function there
    assert model.model.layers[1]._gradient_checkpointing_func is plans.funcs[1]


class _WritesIntoItsOutput(transformers.models.llama.modeling_llama.LlamaMLP):
    """Adds to its down projection's output in place, as GPT-OSS's experts add their bias to the
    grouped matmul's (transformers/integrations/moe.py), then an op that saves it."""

    def forward(self, x):
        hidden = (self.act_fn(self.gate_proj(x)) * self.up_proj(x)).flatten(0, -2)
        out = torch.mm(hidden, self.down_proj.weight.t())  # 2-D, as the grouped matmul's
        return torch.nn.functional.silu(out.add_(1.0)).view_as(x)


def test_an_operator_writing_into_a_kept_output_refuses_that_lever_on_that_layer_alone():
    """Keeping the matmuls would cache the down projection's output that the MLP then changes,
    which selective checkpointing refuses in the backward: the probed step sees the write, and
    the lever is left out on that layer alone, said in the plan's line."""
    model = _llama(True, dropout=0.0, layers=3)
    model.model.layers[1].mlp.__class__ = _WritesIntoItsOutput
    facts, costs = _probed(model)
    assert [f.refused for f in facts.layers[::2]] == [{}, {}]
    assert facts.layers[1].refused[MATMUL].endswith("writes into a kept output")
    refused = costs.layers[1].refused[KEEP_MATMULS]
    assert "add_" in refused and "writes into a kept output" in refused, refused
    assert KEEP_ATTENTION in costs.layers[1].held  # the attention output is not written
    assert all(KEEP_MATMULS in costs.layers[i].held for i in (0, 2))
    said = plan_lines.refused_text(Outcome(costs=costs))
    assert said == ("; keeping the matmuls refused on 1 of 3 layers", "; 1 lever refused")
    _wrap(model, KEEP_MATMULS, only=1)  # what leaving it out spares the job
    with pytest.raises(RuntimeError, match="mutated"):
        _grads(model)


def test_checkpointing_the_mlp_alone_is_exact_fires_and_recomputes_only_its_gate_and_up():
    """Exact with dropout; without it the backward recomputes each layer's gate and up
    projections (early stop before the down one) and no attention, where whole does."""
    plain_grads, _ = _grads(_llama(False))
    model = _llama(True)
    wrapped = _wrap(model, FEED_FORWARD)
    grads, _ = _grads(model)
    assert [w.ran for w in wrapped] == [1, 1]  # one checkpointed call per layer and forward
    assert _same(grads, plain_grads)
    _, plain = _grads(_llama(False, dropout=0.0), counter=_counted())
    _, whole = _grads(_llama(True, dropout=0.0), counter=_counted())
    model = _llama(True, dropout=0.0)
    _wrap(model, FEED_FORWARD)
    _, split = _grads(model, counter=_counted())
    tokens, hidden, inner, layers = 2 * 16, 32, 64, 2
    gate_and_up = layers * 2 * (2 * tokens * hidden * inner)
    assert split["aten.mm"] == plain["aten.mm"] + gate_and_up < whole["aten.mm"]
    assert whole[KERNEL] > 0 and KERNEL not in split


def test_checkpointing_the_moe_block_alone_is_exact_and_not_offered_where_it_writes_its_input():
    """Mixtral's sparse MoE block alone is exact. Its router jitter multiplies the block's input
    in place (its saved input would change by the recompute, which autograd refuses): the probed
    step sees the write and does not offer it."""
    plain_grads, plain = _grads(_mixtral(False), counter=_counted())
    model = _mixtral(True)
    wrapped = _wrap(model, FEED_FORWARD)
    grads, split = _grads(model, counter=_counted())
    assert [w.ran for w in wrapped] == [1, 1] and _same(grads, plain_grads)
    assert split[GROUPED] > plain[GROUPED]  # the experts ran again in the backward
    _, costs = _probed(_mixtral(True))
    assert all(FEED_FORWARD in layer.held for layer in costs.layers)
    facts, costs = _probed(_mixtral(True, jitter=0.1))
    assert [f.refused[BLOCK] for f in facts.layers] == ["its block writes its input"] * 2
    assert all(FEED_FORWARD not in layer.held for layer in costs.layers)
    model = _mixtral(True, jitter=0.1)
    _wrap(model, FEED_FORWARD)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grads(model)  # what not offering it spares the job


def test_checkpointing_the_mlp_alone_under_peft_lora_is_exact():
    """LoRA on the MLP's projections, with LoRA dropout (drawn again in the recompute)."""
    peft = pytest.importorskip("peft")

    def lora(checkpointing):
        torch.manual_seed(5)
        model = peft.get_peft_model(
            _llama(checkpointing),
            peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj"], lora_dropout=0.1),
        )
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param)  # B starts at zero: no gradient reaches A
        return model

    expected, _ = _grads(lora(False))
    model = lora(True)
    wrapped = _wrap(model, FEED_FORWARD)
    got, _ = _grads(model)
    assert [w.ran for w in wrapped] == [1, 1] and len(got) == 8  # A and B, 2 modules, 2 layers
    assert _same(got, expected)


def test_the_recompute_calls_the_block_through_its_hooks_and_another_tools_forward_stays():
    """The recompute goes through the block's `__call__`, as a whole layer's does (a ZeRO-3 block
    gathers its parameters in a pre-hook); a `forward` another tool set on the block (accelerate's
    hooks) is the one checkpointed, and is back afterwards."""
    model = _llama(True)
    _wrap(model, FEED_FORWARD)
    block = model.model.layers[0].mlp
    calls, theirs = [], block.forward

    def tools_forward(*args, **kwargs):
        calls.append("forward")
        return theirs(*args, **kwargs)

    block.forward = tools_forward
    block.register_forward_pre_hook(lambda module, args: calls.append("pre-hook"))
    loss = model(input_ids=IDS, labels=IDS).loss
    assert calls == ["pre-hook", "forward"] and vars(block)["forward"] is tools_forward
    loss.backward()
    assert calls == ["pre-hook", "forward"] * 2  # the recompute, through the hook
    del vars(block)["forward"]
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert "forward" not in vars(block)  # none set: none left behind


# families, the config keywords each needs at hidden 32, and the class of its feed-forward block
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
    "GPT2": ({}, "GPT2MLP"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_mlp_alone_is_found_offered_and_exact_across_families(family):
    """The block by its name in each family (GPT-2's MLP carries its own residual dropout, drawn
    again in the recompute): offered by the probed step, holding less than plain, exact."""
    make = functools.partial(_tiny, family, **FAMILIES[family][0])
    expected, _ = _grads(make(False))
    model = make(True)
    layers = _decoder_layers(model)
    assert [type(feed_forward.block(m)).__name__ for m in layers] == [FAMILIES[family][1]] * 2
    wrapped = _wrap(model, FEED_FORWARD)
    got, _ = _grads(model)
    assert [w.ran for w in wrapped] == [1, 1] and _same(got, expected)
    facts, costs = _probed(make(True))
    assert all(f.block_ran and f.block_only.total > 0 for f in facts.layers)
    for layer in costs.layers:
        assert layer.held[WHOLE].total < layer.held[FEED_FORWARD].total < layer.held[PLAIN].total


def test_a_layer_without_a_known_feed_forward_block_is_not_offered_the_mlp_alone():
    model = _tiny("OPT", True, layers=1, ffn_dim=64)
    assert [feed_forward.block(m) for m in _decoder_layers(model)] == [None]  # fc1, fc2 inline
    _, costs = _probed(model)
    [layer] = costs.layers
    assert layer.refused[FEED_FORWARD] == "the layer has no feed-forward block by a known name"
    assert KEEP_MATMULS in layer.held


@pytest.mark.parametrize(
    "dtype, dropout",
    [(torch.float32, 0.0), (torch.bfloat16, 0.0), (torch.float32, 0.1)],
    ids=["fp32", "bf16", "fp32-dropout"],
)
def test_the_probed_figures_are_what_a_forward_in_each_mix_of_modes_holds(dtype, dropout):
    """The plan's bytes for a mix of modes over 3 layers are what a forward in that mix holds
    (gcpatch/step/held.py), at the probed shape and twice its tokens (with dropout, attention scores
    grow with the tokens' square). Whole, a layer holds its input (bf16: an fp32 copy is saved)."""
    model = _llama(True, dropout=dropout, layers=3).to(dtype)
    layers = _decoder_layers(model)
    _, costs = _probed(model)
    modes = list(costs.layers[0].held)  # plain, and every lever offered
    assert (KEEP_ATTENTION in modes) == (dropout == 0.0) and len(modes) >= 4
    hidden = 2 * 16 * 32 * dtype.itemsize
    assert [layer.held[WHOLE].total for layer in costs.layers] == [hidden] * 3
    plans = shapes.ShapePlans(model, layers, costs, parse("0.5"), "m")
    mixes = [(m,) * 3 for m in modes] + [
        tuple(modes[(i + j) % len(modes)] for j in range(3)) for i in range(len(modes))
    ]
    for rows, tokens in ((2, 16), (2, 32)):
        ids = torch.randint(0, 64, (rows, tokens), generator=torch.Generator().manual_seed(2))
        at, outside, _ = costs.at(rows, tokens)
        for mix in mixes if tokens == 16 else mixes[: len(modes)]:
            plans.apply(solver.Plan(list(mix), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
            with held_bytes() as held:
                out = model(input_ids=ids, labels=ids)
            real = held.total(returned=out.logits)
            del out  # its graph with it
            planned = outside + sum(layer.held(mode) for layer, mode in zip(at, mix))
            assert planned == pytest.approx(real, rel=0.02), (rows, tokens, mix, planned, real)


@pytest.mark.parametrize("family", ["Llama", "GPT2"])
def test_each_levers_counted_share_is_what_the_backward_recomputes(family):
    """A lever's `counted`, read from the probed step, is the share of whole's recomputed FLOPs
    torch's FLOP counter (CPU attention counted as CUDA's) sees a step under it recompute (the MLP
    alone: its projections before the down one, torch's early stop; keeping the attention output:
    all but the kernel)."""
    make = functools.partial(_tiny, family, dropout=0.0)
    _, plain = _grads(make(False), counter=_counted())
    _, costs = _probed(make(True))
    counted = costs.layers[0].counted
    assert all(layer.counted == counted for layer in costs.layers)
    assert {WHOLE, KEEP_MATMULS, FEED_FORWARD} <= set(counted), counted

    def recomputed(name):
        model = make(True)
        _wrap(model, name)
        return sum(_grads(model, counter=_counted())[1].values()) - sum(plain.values())

    whole = recomputed(WHOLE)
    assert whole > 0
    for name, share in counted.items():
        assert share == pytest.approx(recomputed(name) / whole, abs=1e-9), (name, counted)


@pytest.fixture
def _fresh_budget():
    yield
    first_step.reset()
    shapes.reset()


@pytest.mark.parametrize("asked", ["all", "whole"])
def test_whole_layers_alone_when_the_user_asks(asked, monkeypatch, caplog, _fresh_budget):
    """End to end, GCPATCH_MEMORY_BUDGET=0.5: the first step probed, the plan applied at the
    second. GCPATCH_BUDGET_LEVERS=whole offers no lever but whole (plans of whole layers, the
    same on every run), and says so in the record's details; `all` offers them."""
    monkeypatch.setenv("GCPATCH_MEMORY_BUDGET", "0.5")
    monkeypatch.setenv("GCPATCH_BUDGET_LEVERS", asked)
    model = _llama(True, dropout=0.0, layers=4)
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        for _ in range(2):
            model(input_ids=IDS, labels=IDS).loss.backward()
    plans = shapes.of(model)
    assert plans is not None and plans.last is not None
    lines = [headline.unwrap(r.getMessage()) for r in caplog.records]
    assert len([line for line in lines if " budget " in line]) == 1, lines  # said once
    offered = {name for layer in plans.costs.layers for name in layer.held}
    if asked == "whole":
        assert offered == {PLAIN, WHOLE} and set(plans.last.modes) <= {PLAIN, WHOLE}
        refused = {c.refused[n] for c in plans.costs.layers for n in (KEEP_MATMULS, FEED_FORWARD)}
        assert refused == {cost_model.WHOLE_ASKED}
    else:
        assert {KEEP_MATMULS, KEEP_ATTENTION, FEED_FORWARD} <= offered


def test_a_bad_levers_value_is_said_once_and_taken_as_all(monkeypatch, capsys):
    for raw, expected in ((None, True), ("whole", False), (" ALL ", True), ("halves", True)):
        if raw is None:
            monkeypatch.delenv("GCPATCH_BUDGET_LEVERS", raising=False)
        else:
            monkeypatch.setenv("GCPATCH_BUDGET_LEVERS", raw)
        assert settings.budget_levers() is expected and settings.budget_levers() is expected
    said = [line for line in capsys.readouterr().err.splitlines() if "BUDGET_LEVERS" in line]
    assert said == [
        "gcpatch: GCPATCH_BUDGET_LEVERS='halves' is neither all nor whole; every lever, as with all"
    ]
