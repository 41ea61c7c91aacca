"""FSDP facts (facts.fsdp_facts): FSDP's own activation checkpointing read from the modules
(checkpoint_wrapper, with its implementation), the wrap being decided now (the fsdp plugin's
context) and accelerate's launcher environment. FSDP2 `fully_shard` itself needs a process group:
integration/test_fsdp_frozen.py records it on 2 gloo ranks."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from gcpatch.facts import fsdp_facts  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


def _model():
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(4, 1))


def test_nothing_fsdp_gives_empty_facts(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert fsdp_facts(_model(), {}) == {"fsdp": "", "fsdp_checkpointing": ""}


@pytest.mark.parametrize("impl", ["NO_REENTRANT", "REENTRANT"])
def test_fsdp_checkpoint_wrappers_are_counted_with_their_implementation(monkeypatch, impl):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    model = _model()
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl[impl]
        ),
        check_fn=lambda m: isinstance(m, Block),
    )
    assert fsdp_facts(model, {}) == {
        "fsdp": "",
        "fsdp_checkpointing": f"checkpoint_wrapper: 2 modules ({impl.lower()})",
    }


def test_the_wrap_being_decided_and_accelerates_launcher_are_facts(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    facts = fsdp_facts(_model(), {"fsdp": "fsdp2"})
    assert facts == {
        "fsdp": "fsdp2, accelerate:fsdp2",
        "fsdp_checkpointing": "accelerate FSDP plugin activation_checkpointing (planned)",
    }
