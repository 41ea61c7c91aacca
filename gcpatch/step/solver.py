"""The cheapest checkpointing plan that meets a memory budget: pure arithmetic, no torch.

A plan is a per-layer choice: a checkpointed layer holds only its outputs and costs its forward
again in the backward, a plain one holds every tensor its backward needs. Choosing the layers is a
0/1 knapsack (cover the bytes to shed at the least recompute), solved exactly over the Pareto front
of (bytes shed, recompute) and checked against exhaustive search in tests/unit/test_budget.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

PLAIN, KEEP_MATMULS, FULL = "plain", "keep-matmuls", "full"
# Beyond this many Pareto points (distinct sums of bytes shed) the exact search is cut short: the
# cheapest-per-byte layers are taken instead, and the plan says so. Identical layers give n + 1.
MAX_FRONT = 20000


@dataclass(frozen=True)
class LayerCost:
    """One checkpointable layer, measured: bytes it holds after the forward plain and checkpointed,
    and the seconds its recompute costs. `kind` groups layers that are interchangeable."""

    name: str
    plain: float
    checkpointed: float
    seconds: float
    kind: str = ""
    # checkpointed keeping its matmuls' outputs (gcpatch/step/selective.py): bytes held and seconds
    # per step; None where that option is not available
    kept: float | None = None
    kept_seconds: float = 0.0

    @property
    def shed(self) -> float:
        return self.plain - self.checkpointed

    def options(self) -> list[tuple[str, float, float]]:
        """(mode, bytes shed, seconds) of each useful way to run this layer, plain first."""
        out = [(PLAIN, 0.0, 0.0)]
        if self.kept is not None and self.kept < self.plain and self.kept_seconds < self.seconds:
            out.append((KEEP_MATMULS, self.plain - self.kept, self.kept_seconds))
        if self.shed > 0:
            out.append((FULL, self.shed, self.seconds))
        return out


@dataclass
class Plan:
    """How each layer runs (plain, checkpointed keeping its matmuls, checkpointed whole), and what
    that is expected to hold and cost."""

    modes: list[str]
    limit: float  # the budget in bytes
    plain_total: float  # everything plain
    floor: float  # every candidate layer checkpointed
    total: float  # this plan
    recompute_s: float
    full_recompute_s: float
    exact: bool = True
    names: list[str] = field(default_factory=list)

    @property
    def checkpoint(self) -> list[bool]:
        return [mode != PLAIN for mode in self.modes]

    @property
    def count(self) -> int:
        return sum(self.checkpoint)

    @property
    def kept_matmuls(self) -> int:
        return sum(mode == KEEP_MATMULS for mode in self.modes)

    @property
    def below_floor(self) -> bool:
        return self.limit < self.floor

    def every_n_layers(self) -> int | None:
        """The `every_n_layers` of transformers' enable that expresses this plan (layer i
        checkpoints whole iff i % n == 0, no layer keeps its matmuls), or None."""
        if self.kept_matmuls:
            return None
        n_layers = len(self.modes)
        for n in range(1, n_layers + 1):
            if all(flag == (i % n == 0) for i, flag in enumerate(self.checkpoint)):
                return n
        return None


def solve(layers: Sequence[LayerCost], outside: float, limit: float) -> Plan:
    """The plan holding at most `limit` bytes with the least recompute (ties: fewer bytes held);
    a limit below the floor gives every layer checkpointed whole. Each layer's options
    (`LayerCost.options`) make it a multiple-choice knapsack, solved exactly over the Pareto front
    of (bytes shed, seconds)."""
    plain_total = outside + sum(layer.plain for layer in layers)
    floor = outside + sum(min(layer.plain, layer.checkpointed) for layer in layers)
    full_s = sum(layer.seconds for layer in layers if layer.shed > 0)
    need = plain_total - limit
    exact = True
    modes = [PLAIN] * len(layers)
    if need <= 0:
        pass
    elif limit < floor:
        modes = [FULL if layer.shed > 0 else PLAIN for layer in layers]
    else:
        found = _cheapest_cover(layers, need)
        if found is None:
            exact = False
            found = _greedy_cover(layers, need)
        for i, mode in found:
            modes[i] = mode
        modes = _spread(layers, modes)
    held = {PLAIN: lambda c: c.plain, FULL: lambda c: min(c.plain, c.checkpointed)}
    total = outside + sum(
        (layer.kept or 0.0) if mode == KEEP_MATMULS else held[mode](layer)
        for layer, mode in zip(layers, modes)
    )
    seconds = {PLAIN: 0.0}
    return Plan(
        modes=modes,
        limit=limit,
        plain_total=plain_total,
        floor=floor,
        total=total,
        recompute_s=sum(
            layer.kept_seconds if mode == KEEP_MATMULS else seconds.get(mode, layer.seconds)
            for layer, mode in zip(layers, modes)
        ),
        full_recompute_s=full_s,
        exact=exact,
        names=[layer.name for layer in layers],
    )


Pick = tuple[tuple[int, str], ...]


def _cheapest_cover(layers: Sequence[LayerCost], need: float) -> list[tuple[int, str]] | None:
    """Exact: the choice per layer shedding at least `need` bytes at the least recompute seconds,
    by dynamic programming over the Pareto front of (bytes shed, seconds). None when the front
    outgrows MAX_FRONT."""
    # front: shed -> (seconds, chosen (layer, mode) pairs); only non-dominated points are kept
    front: dict[float, tuple[float, Pick]] = {0.0: (0.0, ())}
    for i, layer in enumerate(layers):
        options = layer.options()[1:]
        if not options:
            continue
        grown = dict(front)
        for shed, (seconds, picked) in front.items():
            for mode, more, cost in options:
                key = shed + more
                cand = (seconds + cost, picked + ((i, mode),))
                old = grown.get(key)
                if old is None or cand[0] < old[0]:
                    grown[key] = cand
        front = _pareto(grown, need)
        if len(front) > MAX_FRONT:
            return None
    best = None
    for shed, (seconds, picked) in front.items():
        if shed >= need and (best is None or (seconds, -shed) < (best[0], -best[1])):
            best = (seconds, shed, picked)
    return list(best[2]) if best is not None else None


def _pareto(points: dict[float, tuple[float, Pick]], need: float) -> dict:
    """Drop every point another one beats on both bytes shed and seconds. Sheds beyond `need`
    are all equally good at covering it, so only the cheapest of them matters, and it keeps
    its own shed (the tie-break prefers shedding more)."""
    out: dict[float, tuple[float, Pick]] = {}
    best_seconds = float("inf")
    for shed in sorted(points, reverse=True):
        seconds, picked = points[shed]
        if seconds < best_seconds:
            out[shed] = (seconds, picked)
            best_seconds = seconds
    covering = [s for s in out if s >= need]
    if len(covering) > 1:
        keep = min(covering, key=lambda s: (out[s][0], -s))
        for s in covering:
            if s != keep:
                del out[s]
    return out


def _greedy_cover(layers: Sequence[LayerCost], need: float) -> list[tuple[int, str]]:
    """Whole layers, the cheapest per byte first (the plan says it is not exact)."""
    useful = [i for i, layer in enumerate(layers) if layer.shed > 0]
    order = sorted(useful, key=lambda i: layers[i].seconds / layers[i].shed)
    picked, shed = [], 0.0
    for i in order:
        if shed >= need:
            break
        picked.append((i, FULL))
        shed += layers[i].shed
    return picked


def _spread(layers: Sequence[LayerCost], modes: list[str]) -> list[str]:
    """Among interchangeable layers (same kind, bytes and seconds) any arrangement of the same
    modes costs the same: the whole-layer ones go to every (n/k)-th, so the plan is what
    transformers' `every_n_layers` would pick where it can; the matmul-keeping ones fill in
    after them in order."""
    groups: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        key = (
            layer.kind,
            layer.plain,
            layer.checkpointed,
            layer.seconds,
            layer.kept,
            layer.kept_seconds,
        )
        groups.setdefault(key, []).append(i)
    out = list(modes)
    for members in groups.values():
        full = sum(modes[i] == FULL for i in members)
        kept = sum(modes[i] == KEEP_MATMULS for i in members)
        spots = [members[(j * len(members)) // full] for j in range(full)] if full else []
        rest = [i for i in members if i not in spots]
        for i in members:
            out[i] = PLAIN
        for i in spots:
            out[i] = FULL
        for j in range(kept):
            out[rest[(j * len(rest)) // kept]] = KEEP_MATMULS
    return out
