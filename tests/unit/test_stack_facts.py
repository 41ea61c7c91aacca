"""R1's facts per checkpointed stack (gcpatch/facts.py), on hand-built module trees in the layouts
transformers uses: a stack of GradientCheckpointingLayer blocks under a runner, a legacy runner
that carries the `gradient_checkpointing` flag itself (transformers < 4.52, ColossalAI's
shardformer), two towers, an encoder feeding a decoder, and ZeRO-3-partitioned sizes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from gcpatch.facts import checkpoint_stacks, stack_facts  # noqa: E402


class GradientCheckpointingLayer(nn.Module):  # matched by name, as transformers' class is
    gradient_checkpointing = False

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.fixed = nn.Parameter(torch.zeros(4), requires_grad=False)  # frozen by construction
        self.layers = nn.ModuleList([GradientCheckpointingLayer() for _ in range(2)])
        self.norm = nn.LayerNorm(4)


class TwoTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.text = Tower()
        self.vision = Tower()
        self.head = nn.Linear(4, 2)


class Legacy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gradient_checkpointing = False
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])


class LegacyTop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Legacy()
        self.head = nn.Linear(4, 2)


def by_stack(model: nn.Module) -> dict:
    return {s["stack"]: s for s in stack_facts(model)}


def freeze(module: nn.Module) -> None:
    for p in module.parameters():
        p.requires_grad_(False)


def test_each_tower_is_a_stack_run_by_its_own_module():
    model = TwoTowers()
    stacks = {name: (owner, len(blocks)) for name, owner, blocks in checkpoint_stacks(model)}
    assert stacks == {"text.layers": (model.text, 2), "vision.layers": (model.vision, 2)}


def test_a_parameter_frozen_by_construction_does_not_starve_a_stack():
    facts = by_stack(TwoTowers())  # `fixed` is frozen, the embeddings train (Whisper's layout)
    assert all(s["inputs_can_require_grad"] and s["trainable_in_blocks"] for s in facts.values()), (
        facts
    )


def test_a_frozen_front_starves_only_its_own_tower():
    model = TwoTowers()
    freeze(model.text.embed)
    facts = by_stack(model)
    assert facts["text.layers"]["inputs_can_require_grad"] is False
    assert facts["vision.layers"]["inputs_can_require_grad"] is True
    # the other tower's trainable front is not counted upstream of this one
    assert facts["text.layers"]["trainable_upstream"] == 0


def test_legacy_runner_blocks_are_its_module_list():
    model = LegacyTop()
    assert [(n, o is model.model, len(b)) for n, o, b in checkpoint_stacks(model)] == [
        ("model.layers", True, 3)
    ]
    assert (
        by_stack(model)["model.layers"]["inputs_can_require_grad"] is True
    )  # all trainable: no R1
    freeze(model.model.embed)
    assert by_stack(model)["model.layers"]["inputs_can_require_grad"] is False


def test_zero3_partitioned_sizes_count_ds_numel():
    model = TwoTowers()
    for (
        p
    ) in model.parameters():  # what deepspeed.zero.Init leaves: empty data, the size in ds_numel
        p.ds_numel = p.numel()
        p.data = torch.empty(0)
    facts = by_stack(model)
    assert facts["text.layers"]["trainable_in_blocks"] == 2 * (16 + 4)
    assert facts["text.layers"]["trainable_upstream"] == 40 + 0  # embed 10x4 (fixed is frozen)
