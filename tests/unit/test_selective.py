"""The budget's finer lever (gcpatch/step/selective.py): a layer checkpointed keeping its matrix
multiplies' outputs. On a real tiny Llama with dropout: the gradients are those without
checkpointing, the policy really keeps outputs, and the backward recomputes no matmul; a layer
planned with it whose policy keeps nothing falls back to whole checkpointing, said once."""

from __future__ import annotations

import functools
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from gcpatch.budget import parse  # noqa: E402
from gcpatch.step import selective, shapes  # noqa: E402
from gcpatch.step.cost_model import CostModel, Curve  # noqa: E402


def _llama(checkpointing: bool):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.1,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _step(model, ids):
    torch.manual_seed(7)  # dropout draws the same masks in every run
    loss = model(input_ids=ids, labels=ids).loss
    counter = FlopCounterMode(display=False)
    with counter:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, counter.get_total_flops()


def test_keeping_matmuls_is_exact_fires_and_recomputes_no_matmul():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain_grads, plain_flops = _step(_llama(False), ids)
    model = _llama(True)
    layers = list(model.model.layers)
    assert all(selective.available(m) for m in layers)
    policies = [selective.KeepMatmuls() for _ in layers]
    for layer, policy in zip(layers, policies):
        layer._gradient_checkpointing_func = selective.keeping(
            layer._gradient_checkpointing_func, policy
        )
    grads, flops = _step(model, ids)
    assert all(p.kept > 0 for p in policies)  # it fired in every layer
    assert all(torch.equal(grads[n], plain_grads[n]) for n in plain_grads)  # exact, dropout on
    assert flops == plain_flops  # matmuls kept: the backward recomputes none of them


def test_a_reentrant_layer_or_a_users_own_context_fn_is_not_offered_the_lever():
    model = _llama(True)
    layer = model.model.layers[0]
    own = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, context_fn=id)
    layer._gradient_checkpointing_func = own
    assert not selective.available(layer)  # the user's selective checkpointing stands as given
    layer._gradient_checkpointing_func = functools.partial(
        torch.utils.checkpoint.checkpoint, use_reentrant=True
    )
    assert not selective.available(layer)  # selective checkpointing needs non-reentrant


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
    plans.policies[1].ops = frozenset()  # this layer's policy matches no op: it cannot fire
    first = plans.plan_for(1, 16)
    assert first.modes == ["keep-matmuls", "keep-matmuls"]
    plans.apply(first)
    plans.ran = True  # a training forward ran with it
    ids = torch.randint(0, 64, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    with caplog.at_level(logging.WARNING, logger="gcpatch"):
        plans.fired()
    [line] = [r.getMessage() for r in caplog.records if "saved nothing" in r.getMessage()]
    assert "keeping the matmul outputs saved nothing in layer(s) 1" in line, line
    again = plans.plan_for(1, 16)
    assert again.modes[1] != "keep-matmuls" and plans.misfired == {1}
    plans.apply(again)
    assert "context_fn" not in layers[1]._gradient_checkpointing_func.keywords


# Rounds of (plain, whole, keep) seconds measured by `selective.ratio` on an 8-layer Llama, 2 rows:
# hidden 32 x 64 tokens alone, the same with three more copies on a 2-core machine, hidden 256 x
# 256 tokens alone (milliseconds, process CPU time).
TINY = [(18.7, 46.0, 78.8), (19.1, 46.9, 79.5), (32.6, 62.1, 94.0)]
TINY_LOADED = [(131.0, 1174.9, 365.9), (60.4, 213.1, 423.4), (550.6, 729.9, 843.9)]
HIDDEN_256 = [(417.4, 539.5, 495.1), (411.7, 539.7, 496.2), (405.5, 547.1, 487.3)]


def _rounds(rows):
    return [dict(zip(("plain", "whole", "keep"), (ms / 1000 for ms in row))) for row in rows]


def test_the_measured_share_is_the_least_favourable_round_where_the_clock_can_tell():
    assert selective._worst(_rounds(HIDDEN_256)) == pytest.approx((496.2 - 411.7) / (539.7 - 411.7))
    assert selective._worst(_rounds(TINY)) == pytest.approx((78.8 - 18.7) / (46.0 - 18.7))
    # its first round alone would have chosen the lever at 0.23 of whole checkpointing's cost
    assert (365.9 - 131.0) / (1174.9 - 131.0) < 0.25
    assert (
        selective._worst(_rounds(TINY_LOADED)) is None
    )  # spreads of 490 ms hide a 150 ms recompute
