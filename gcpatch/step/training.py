"""Which forwards are a training step's: the ones the first step's work and the budget's per-shape
plans act on."""

from __future__ import annotations

import sys
from typing import Any

from gcpatch.facts import passes_kv_cache
from gcpatch.step import invisible


def training_forward(kwargs: dict) -> bool:
    """A forward that builds a graph for a training step: grad on, not gcpatch's own pass, not
    traced by torch.compile (deciding is eager work; it waits for an eager forward), not asking
    for a KV cache."""
    torch = sys.modules["torch"]
    if invisible.active() or not torch.is_grad_enabled() or _compiling(torch):
        return False
    return _trains(kwargs)


def compiled_training_forward(kwargs: dict) -> bool:
    """A training forward being traced by torch.compile: the first step's work cannot run there."""
    torch = sys.modules["torch"]
    return _compiling(torch) and torch.is_grad_enabled() and _trains(kwargs)


def _compiling(torch: Any) -> bool:
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and compiler.is_compiling()


def _trains(kwargs: dict) -> bool:
    """Not asking for a KV cache (a decode step builds a graph only where the user trains on it)."""
    return kwargs.get("use_cache") is not True and not passes_kv_cache(kwargs)
