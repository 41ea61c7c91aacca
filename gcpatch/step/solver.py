"""The cheapest checkpointing plan that meets a memory budget: pure arithmetic, no torch.

A plan is a per-layer choice: a checkpointed layer holds only its outputs and costs its forward
again in the backward, a plain one holds every tensor its backward needs. Choosing the layers is a
0/1 knapsack (cover the bytes to shed at the least recompute), solved exactly over the Pareto front
of (bytes shed, recompute) and checked against exhaustive search in tests/unit/test_budget.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

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

    @property
    def shed(self) -> float:
        return self.plain - self.checkpointed


@dataclass
class Plan:
    """Which layers checkpoint, and what that is expected to hold and cost."""

    checkpoint: list[bool]
    limit: float  # the budget in bytes
    plain_total: float  # everything plain
    floor: float  # every candidate layer checkpointed
    total: float  # this plan
    recompute_s: float
    full_recompute_s: float
    exact: bool = True
    names: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(self.checkpoint)

    @property
    def below_floor(self) -> bool:
        return self.limit < self.floor

    def every_n_layers(self) -> int | None:
        """The `every_n_layers` of transformers' enable that expresses this plan (layer i
        checkpoints iff i % n == 0), or None."""
        n_layers = len(self.checkpoint)
        for n in range(1, n_layers + 1):
            if all(flag == (i % n == 0) for i, flag in enumerate(self.checkpoint)):
                return n
        return None


def solve(layers: Sequence[LayerCost], outside: float, limit: float) -> Plan:
    """The plan holding at most `limit` bytes with the least recompute (ties: fewer bytes held);
    a limit below the floor gives every layer checkpointed."""
    plain_total = outside + sum(layer.plain for layer in layers)
    floor = outside + sum(min(layer.plain, layer.checkpointed) for layer in layers)
    full_s = sum(layer.seconds for layer in layers if layer.shed > 0)
    need = plain_total - limit
    useful = [i for i, layer in enumerate(layers) if layer.shed > 0]
    exact = True
    if need <= 0:
        chosen: set[int] = set()
    elif limit < floor:
        chosen = set(useful)
    else:
        found = _cheapest_cover([layers[i] for i in useful], need)
        if found is None:
            exact = False
            found = _greedy_cover([layers[i] for i in useful], need)
        chosen = {useful[j] for j in found}
        chosen = _spread(layers, chosen)
    flags = [i in chosen for i in range(len(layers))]
    total = outside + sum(
        layer.checkpointed if flag else layer.plain for layer, flag in zip(layers, flags)
    )
    return Plan(
        checkpoint=flags,
        limit=limit,
        plain_total=plain_total,
        floor=floor,
        total=total,
        recompute_s=sum(layer.seconds for layer, flag in zip(layers, flags) if flag),
        full_recompute_s=full_s,
        exact=exact,
        names=[layer.name for layer in layers],
    )


def _cheapest_cover(layers: Sequence[LayerCost], need: float) -> list[int] | None:
    """Exact: the subset shedding at least `need` bytes at the least recompute seconds, by
    dynamic programming over the Pareto front of (bytes shed, seconds). None when the front
    outgrows MAX_FRONT."""
    # front: shed -> (seconds, chosen indices); only non-dominated points are kept
    front: dict[float, tuple[float, tuple[int, ...]]] = {0.0: (0.0, ())}
    for i, layer in enumerate(layers):
        grown = dict(front)
        for shed, (seconds, picked) in front.items():
            key = shed + layer.shed
            cand = (seconds + layer.seconds, picked + (i,))
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


def _pareto(points: dict[float, tuple[float, tuple[int, ...]]], need: float) -> dict:
    """Drop every point another one beats on both bytes shed and seconds. Sheds beyond `need`
    are all equally good at covering it, so only the cheapest of them matters, and it keeps
    its own shed (the tie-break prefers shedding more)."""
    out: dict[float, tuple[float, tuple[int, ...]]] = {}
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


def _greedy_cover(layers: Sequence[LayerCost], need: float) -> list[int]:
    order = sorted(range(len(layers)), key=lambda i: layers[i].seconds / layers[i].shed)
    picked, shed = [], 0.0
    for i in order:
        if shed >= need:
            break
        picked.append(i)
        shed += layers[i].shed
    return picked


def _spread(layers: Sequence[LayerCost], chosen: set[int]) -> set[int]:
    """Among interchangeable layers (same kind, bytes and seconds) any k of them cost the same:
    take every (n/k)-th, so the plan is what transformers' `every_n_layers` would pick where it can.
    """
    groups: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        groups.setdefault((layer.kind, layer.plain, layer.checkpointed, layer.seconds), []).append(
            i
        )
    out: set[int] = set()
    for members in groups.values():
        k = sum(1 for i in members if i in chosen)
        if k:
            out.update(members[(j * len(members)) // k] for j in range(k))
    return out
