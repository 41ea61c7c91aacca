"""GCPATCH_MEMORY_BUDGET: what a budget value means. The plan that meets it is made at the first
training step (gcpatch/step/): its arithmetic in gcpatch/step/solver.py.

A budget is the activation memory each training step may hold after its forward: a fraction of what
that step itself holds without checkpointing (`0.5`), a size (`6GiB`, `800MB`), or `auto`: what the
accelerator has left at each step (its memory, or a capacity stated as `auto:24GiB`, minus what the
job already holds there, minus a margin of AUTO_MARGIN of the capacity for the backward's own
working memory). Pure parsing: imported only when the variable is set (settings.py is on the
start-up path).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# ASCII digits only: `re`'s \d would take other scripts' digits, which float() reads differently.
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
# No device holds more than this; a larger size is a typo, not a budget (2**60 bytes: 1 EiB).
_LARGEST = 2**60


AUTO_MARGIN = 0.1  # of the device's capacity, kept free under `auto` for the backward's work


@dataclass(frozen=True)
class Budget:
    """A parsed GCPATCH_MEMORY_BUDGET: `fraction` (of each step's own plain bytes), `nbytes`, or
    `auto` (with the device's `capacity` when stated)."""

    text: str
    fraction: float | None = None
    nbytes: int | None = None
    auto: bool = False
    capacity: int | None = None

    def limit(self, plain_bytes: float, available: float | None = None) -> float:
        """The bytes one step may hold: `plain_bytes` is that step's without checkpointing;
        `available` what `auto` found free for activations at that step."""
        if self.fraction is not None:
            return self.fraction * plain_bytes
        if self.auto:
            return max(0.0, available or 0.0)
        return float(self.nbytes or 0)


def parse(raw: str) -> Budget | str:
    """A Budget, or why `raw` is not one, as a clause settings.py puts in its one line."""
    text = raw.strip()
    if text.lower() == "auto" or text.lower().startswith("auto:"):
        return _auto(text)
    match = _SIZE.match(text)
    if not match:
        return "neither a fraction like 0.5 nor a size like 6GiB or 800MB"
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        return f"its unit {match.group(2)!r} is not one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
    if not math.isfinite(number):
        return "too large to be a number"
    if not unit:
        if 0 < number <= 1:
            return Budget(text, fraction=number)
        return (
            "a number without a unit, which must be a fraction in (0, 1] (a size needs a unit:"
            " 800MB, 6GiB)"
        )
    nbytes = number * _UNITS[unit]
    if nbytes < 1:
        return "a size must be at least one byte"
    if nbytes > _LARGEST:
        return f"larger than any device's memory ({size(_LARGEST)})"
    return Budget(text, nbytes=int(nbytes))


def _auto(text: str) -> Budget | str:
    """`auto`, or `auto:<size>` stating the device's capacity (a shared GPU, a CPU test)."""
    _, _, stated = text.partition(":")
    if not stated.strip():
        return Budget(text, auto=True) if ":" not in text else "auto: names no capacity"
    capacity = parse(stated)
    if isinstance(capacity, str) or capacity.nbytes is None:
        why = capacity if isinstance(capacity, str) else "a fraction is not a capacity"
        return f"its capacity {stated.strip()!r} is not a size ({why})"
    return Budget(text, auto=True, capacity=capacity.nbytes)


def size(n: float) -> str:
    """A byte count for a log line."""
    for unit, scale in (
        ("EiB", 2**60),
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
    ):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
