"""The budget's levers: the ways a checkpointed layer can run besides plain, one file each, in one
registry. A lever says where it is offered, the bytes it keeps (from what the probed step showed,
gcpatch/step/probe.py), what share of a whole layer's recompute it costs, how it wraps the layer's
checkpoint function, and how a step tells it fired. Adding one: a file with its `Lever` and a line
in BUILT_IN (or `register` from outside). The words are the glossary's (docs/BUDGET.md)."""

from __future__ import annotations

from typing import Any

from gcpatch.step.levers import feed_forward, keep_attention, keep_matmuls, offload, whole
from gcpatch.step.levers.lever import Lever

_registry: dict[str, Lever] = {}


def register(lever: Lever) -> None:
    """A lever the budget measures, plans, installs, reports and records from now on."""
    _registry[lever.name] = lever


def unregister(name: str) -> None:
    _registry.pop(name, None)


def every() -> list[Lever]:
    """The registered levers, in the order a group of like layers is filled (whole first)."""
    return list(_registry.values())


def get(name: str) -> Lever | None:
    return _registry.get(name)


def own(func: Any) -> Any:
    """The layer's own checkpoint function, where `func` is a lever's wrapper of it."""
    for lever in every():
        inner = lever.own(func)
        if inner is not None:
            return own(inner)
    return func


BUILT_IN = (
    whole.LEVER,
    keep_attention.LEVER,
    keep_matmuls.LEVER,
    feed_forward.LEVER,
    offload.LEVER,
)
WHOLE = whole.LEVER
for _lever in BUILT_IN:
    register(_lever)
