"""The cheapest checkpointing plan that meets a memory budget: pure arithmetic, no torch.

A plan is a per-layer choice: a checkpointed layer holds only its outputs and costs its forward
again in the backward, a plain one holds every tensor its backward needs. Choosing the layers is a
0/1 knapsack (cover the bytes to shed at the least recompute), solved exactly over the Pareto front
of (bytes shed, recompute) and checked against exhaustive search in tests/unit/test_budget.py.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Iterator, Sequence

PLAIN, KEEP_MATMULS, KEEP_ATTENTION, FULL = "plain", "keep-matmuls", "keep-attention", "full"
# checkpointed whole with its inputs in host memory (gcpatch/step/offload.py): below whole's bytes,
# for the copies' time besides the recompute; only where the layers run on an accelerator
OFFLOAD = "offload"
# run plain with its feed-forward block alone checkpointed (gcpatch/step/feed_forward.py)
FEED_FORWARD = "feed-forward"
# the levers between plain and whole (gcpatch/step/selective.py, gcpatch/step/feed_forward.py)
SELECTIVE = (KEEP_ATTENTION, KEEP_MATMULS, FEED_FORWARD)
# the modes a group of like layers is filled with after its whole ones, in this order
FILLED = (*SELECTIVE, OFFLOAD)
# the modes that recompute a layer's matrix multiplies: whole (offloaded or not), keeping only the
# attention kernel's output (its projections and MLP run again), and its feed-forward block alone
RECOMPUTES_MATMULS = (FULL, KEEP_ATTENTION, OFFLOAD, FEED_FORWARD)
# Beyond this many Pareto points (distinct sums of bytes shed) the exact search is cut short, and
# the greedy over each layer's convex hull of options is taken instead (`_greedy_cover`: within one
# layer's recompute of the cheapest; the plan records it is not exact). Like layers give few points;
# layers that each hold other bytes (MoE layers routed differently) many: 80 such layers took 4 to
# 11 s to solve at 20000, in the step's pre-hook, and take well under one at this bound.
MAX_FRONT = 2000
# Plans whose measured recompute is within this share of full checkpointing's of the cheapest are
# one price on this clock: the lever's measured cost moved by more between runs on a shared CPU
# (keeping the matmuls measured 0.16 to 0.35 of a whole layer for one model). Among them the plan
# recomputing the fewest matmuls wins (`_fewest_matmuls`, `LayerCost.redone`): their FLOPs,
# counted on one layer, do not move with the clock. Weighed by seconds instead, a CI run's loaded
# clock planned 1 whole layer and 6 with the feed-forward block alone (0.37 of full checkpointing's
# FLOPs): where the block alone measures above half a whole layer that plan is both the cheapest
# and the fewest matmul seconds, while 8 so recompute 0.33 (tests/unit/test_budget.py).
SLACK = 0.05


def search_text(exact: bool) -> str:
    """What a plan's line adds where the exact search was cut short (`MAX_FRONT`): the user reads
    that the plan is not the proven cheapest, and by how much it may miss."""
    if exact:
        return ""
    return " (greedy: within one layer's recompute of the cheapest)"


@dataclass(frozen=True)
class LayerCost:
    """One checkpointable layer, measured: bytes it holds after the forward plain and checkpointed,
    and the seconds its recompute costs. `kind` groups layers that are interchangeable."""

    name: str
    plain: float
    checkpointed: float
    seconds: float
    kind: str = ""
    # checkpointed keeping its matmuls' outputs, and keeping only its attention kernel's
    # (gcpatch/step/selective.py): bytes held and seconds per step; None where not available
    kept: float | None = None
    kept_seconds: float = 0.0
    attention: float | None = None
    attention_seconds: float = 0.0
    # checkpointed whole with its inputs offloaded to host memory (gcpatch/step/offload.py)
    offloaded: float | None = None
    offloaded_seconds: float = 0.0
    # run plain with its feed-forward block alone checkpointed (gcpatch/step/feed_forward.py)
    feed_forward: float | None = None
    feed_forward_seconds: float = 0.0
    # what each lever recomputes of the layer's matmul FLOPs, as a share of whole's (counted on
    # one layer, gcpatch/step/flops.py): (mode, share) pairs; empty where not counted
    matmuls: tuple[tuple[str, float], ...] = ()

    @property
    def shed(self) -> float:
        return self.plain - self.checkpointed

    @property
    def least(self) -> float:
        """The fewest bytes the layer can hold, in any of its options."""
        return self.plain - max(shed for _, shed, _ in self.options())

    def fewest_mode(self) -> str:
        """The option holding the fewest bytes (a budget below the floor takes it)."""
        return max(self.options(), key=lambda option: (option[1], -option[2]))[0]

    def held(self, mode: str) -> float:
        """The bytes the layer holds after its forward in `mode`."""
        return {
            PLAIN: self.plain,
            KEEP_MATMULS: self.kept,
            KEEP_ATTENTION: self.attention,
            FULL: min(self.plain, self.checkpointed),
            OFFLOAD: self.offloaded,
            FEED_FORWARD: self.feed_forward,
        }[mode] or 0.0

    def cost(self, mode: str) -> float:
        """What running the layer in `mode` adds to the backward, in seconds."""
        return {
            PLAIN: 0.0,
            KEEP_MATMULS: self.kept_seconds,
            KEEP_ATTENTION: self.attention_seconds,
            FULL: self.seconds,
            OFFLOAD: self.offloaded_seconds,
            FEED_FORWARD: self.feed_forward_seconds,
        }[mode]

    def redone(self, mode: str) -> float:
        """The matmuls running in `mode` recomputes, in seconds of the layer's whole recompute:
        its counted FLOPs' share of whole's (whole and offloaded: all of them), else, not counted,
        the mode's seconds where it recomputes matmuls (RECOMPUTES_MATMULS)."""
        counted = dict(self.matmuls)
        if counted and mode in (FULL, OFFLOAD):
            return self.seconds
        if mode in counted:
            return counted[mode] * self.seconds
        return self.cost(mode) if mode in RECOMPUTES_MATMULS else 0.0

    def options(self) -> list[tuple[str, float, float]]:
        """(mode, bytes shed, seconds) of each useful way to run this layer, plain first: a lever
        between plain and whole where it holds less than plain for less than a whole recompute,
        offloading where it holds less than whole."""
        out = [(PLAIN, 0.0, 0.0)]
        for mode, held in (
            (KEEP_ATTENTION, self.attention),
            (KEEP_MATMULS, self.kept),
            (FEED_FORWARD, self.feed_forward),
        ):
            if held is not None and held < self.plain and self.cost(mode) < self.seconds:
                out.append((mode, self.plain - held, self.cost(mode)))
        if self.shed > 0:
            out.append((FULL, self.shed, self.seconds))
        if self.offloaded is not None and self.offloaded < min(self.plain, self.checkpointed):
            out.append((OFFLOAD, self.plain - self.offloaded, self.offloaded_seconds))
        return out


@dataclass
class Plan:
    """How each layer runs (plain, checkpointed keeping its matmuls or its attention output, plain
    with its feed-forward block checkpointed, checkpointed whole, offloaded), and what that is
    expected to hold and cost."""

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
    def kept_attention(self) -> int:
        return sum(mode == KEEP_ATTENTION for mode in self.modes)

    @property
    def offloaded(self) -> int:
        return sum(mode == OFFLOAD for mode in self.modes)

    @property
    def below_floor(self) -> bool:
        return self.limit < self.floor

    def every_n_layers(self) -> int | None:
        """The `every_n_layers` of transformers' enable that expresses this plan (layer i
        checkpoints whole iff i % n == 0, no selective or offloaded layer), or None."""
        if any(mode in FILLED for mode in self.modes):
            return None
        n_layers = len(self.modes)
        for n in range(1, n_layers + 1):
            if all(flag == (i % n == 0) for i, flag in enumerate(self.checkpoint)):
                return n
        return None


def solve(layers: Sequence[LayerCost], outside: float, limit: float) -> Plan:
    """The plan holding at most `limit` bytes with the least recompute (ties: fewer bytes held);
    a limit below the floor gives every layer its option holding the fewest bytes (whole, or
    offloaded where it can be). Each layer's options
    (`LayerCost.options`) make it a multiple-choice knapsack, solved exactly over the Pareto front
    of (bytes shed, seconds). Where a layer has a selective lever, the plans within SLACK of full
    checkpointing's recompute of the cheapest count as one price, and the one recomputing the
    fewest matmuls among them is taken."""
    plain_total = outside + sum(layer.plain for layer in layers)
    floor = outside + sum(layer.least for layer in layers)
    full_s = sum(layer.seconds for layer in layers if layer.shed > 0)
    need = plain_total - limit
    exact = True
    modes = [PLAIN] * len(layers)
    if need <= 0:
        pass
    elif limit < floor:
        modes = [layer.fewest_mode() for layer in layers]
    else:
        found = _cheapest_cover(layers, need)
        if found is None:
            exact = False
            found = _greedy_cover(layers, need)
        elif any(mode in SELECTIVE for layer in layers for mode, _, _ in layer.options()):
            cheapest = sum(layers[i].cost(mode) for i, mode in found)
            found = _fewest_matmuls(layers, need, cheapest + SLACK * full_s) or found
        for i, mode in found:
            modes[i] = mode
        modes = _spread(layers, modes)
    total = outside + sum(layer.held(mode) for layer, mode in zip(layers, modes))
    return Plan(
        modes=modes,
        limit=limit,
        plain_total=plain_total,
        floor=floor,
        total=total,
        recompute_s=sum(layer.cost(mode) for layer, mode in zip(layers, modes)),
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


def _fewest_matmuls(
    layers: Sequence[LayerCost], need: float, bound: float
) -> list[tuple[int, str]] | None:
    """Exact: among the choices shedding at least `need` bytes within `bound` seconds, the one
    whose matmul recompute (`LayerCost.redone`: counted FLOPs, else the seconds of its layers in
    RECOMPUTES_MATMULS) is least (ties: fewer seconds). Interchangeable layers are one group
    (`_groups`), chosen by how many of them run in each mode (`_mixes`, of which only those no
    other mix of the group beats on bytes shed, seconds and matmul recompute at once can be part
    of the best); the states kept between groups are those no other shedding as much beats on
    both seconds and matmul recompute (`_undominated`), and that can still shed `need` with the
    groups left. None when they outgrow MAX_FRONT."""
    groups = list(_groups(layers).values())
    picks, mixes = [], []
    for members in groups:
        first = layers[members[0]]
        options = first.options()[1:]
        picks.append([mode for mode, _, _ in options])
        redone = {mode: first.redone(mode) for mode, _, _ in options}
        found = _undominated(list(_mixes(len(members), options, bound, redone)), need)
        mixes.append(sorted(found, key=lambda mix: mix[1]))
    # the most the groups from each one on can shed
    reach = [0.0] * (len(groups) + 1)
    for g in range(len(groups) - 1, -1, -1):
        reach[g] = reach[g + 1] + max((mix[0] for mix in mixes[g]), default=0.0)
    # a state: (bytes shed, seconds, matmul seconds, (counts per option) per group)
    states: list[tuple[float, float, float, tuple]] = [(0.0, 0.0, 0.0, ())]
    for g, group_mixes in enumerate(mixes):
        grown = []
        for shed, seconds, matmul, picked in states:
            for more, cost, redone, counts in group_mixes:
                if seconds + cost > bound + 1e-12:
                    break
                if shed + more + reach[g + 1] < need:
                    continue
                grown.append((shed + more, seconds + cost, matmul + redone, (*picked, counts)))
        states = _undominated(grown, need)
        if len(states) > MAX_FRONT:
            return None
    covering = [st for st in states if st[0] >= need]
    if not covering:
        return None
    best = min(covering, key=lambda st: (st[2], st[1], -st[0]))
    out = []
    for members, modes, counts in zip(groups, picks, best[3]):
        at = 0
        for mode, count in zip(modes, counts):
            out += [(i, mode) for i in members[at : at + count]]
            at += count
    return out


def _mixes(
    n: int, options: list[tuple[str, float, float]], room: float, redone: dict[str, float]
) -> Iterator[tuple[float, float, float, tuple[int, ...]]]:
    """Every way to run up to `n` like layers in `options` (the rest plain) within `room`
    seconds: (bytes shed, seconds, matmul recompute, count per option); `redone`: each option's
    matmul recompute (`LayerCost.redone`)."""
    if not options:
        yield 0.0, 0.0, 0.0, ()
        return
    (mode, shed, cost), rest = options[0], options[1:]
    for count in range(n + 1):
        if count * cost > room + 1e-12:
            break
        for more, spent, matmul, counts in _mixes(n - count, rest, room - count * cost, redone):
            yield (
                count * shed + more,
                count * cost + spent,
                count * redone[mode] + matmul,
                (count, *counts),
            )


def _undominated(
    states: list[tuple[float, float, float, tuple]], need: float
) -> list[tuple[float, float, float, tuple]]:
    """The states no other beats on bytes shed (up to `need`: beyond it all cover), seconds and
    matmul recompute at once: taken by bytes shed, most first, each kept only where no state
    shedding as much is as cheap on both (a staircase of seconds against matmul recompute)."""
    out: list[tuple[float, float, float, tuple]] = []
    stair_s: list[float] = []  # seconds, rising
    stair_w: list[float] = []  # the least matmul recompute at those seconds or fewer, falling
    for state in sorted(states, key=lambda st: (-min(st[0], need), st[1], st[2])):
        at = bisect.bisect_right(stair_s, state[1])
        if at and stair_w[at - 1] <= state[2]:
            continue
        out.append(state)
        # the new point, then drop the points it makes redundant (more seconds, no less whole)
        end = at
        while end < len(stair_s) and stair_w[end] >= state[2]:
            end += 1
        stair_s[at:end] = [state[1]]
        stair_w[at:end] = [state[2]]
    return out


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
    """Past MAX_FRONT (many layers, each holding other bytes: MoE layers routed differently):
    each layer's options on the lower convex hull of (bytes shed, seconds) from plain, and the
    steps up those hulls taken cheapest per byte first across layers until `need` is shed. The
    greedy of the knapsack's linear relaxation: a lever that sheds enough for less is taken, and
    the plan is within one step of the cheapest, at most one layer's costliest option (it says it
    is not exact)."""
    heap: list[tuple[float, int, int]] = []  # (seconds per byte of the step, layer, hull index)
    hulls = []
    for i, layer in enumerate(layers):
        hull = _hull(layer.options())
        hulls.append(hull)
        if len(hull) > 1:
            heapq.heappush(heap, (_slope(hull, 1), i, 1))
    at = [0] * len(layers)
    shed = 0.0
    while heap and shed < need:
        _, i, step = heapq.heappop(heap)
        shed += hulls[i][step][1] - hulls[i][step - 1][1]
        at[i] = step
        if step + 1 < len(hulls[i]):
            heapq.heappush(heap, (_slope(hulls[i], step + 1), i, step + 1))
    return [(i, hulls[i][step][0]) for i, step in enumerate(at) if step]


def _hull(options: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """The options on the lower convex hull of (bytes shed, seconds), plain first: each next one
    sheds more, for more seconds per byte than the step before it (an option shedding less for no
    fewer seconds than another is never on it)."""
    plain, *rest = options
    hull = [plain]
    for point in sorted(rest, key=lambda o: (o[1], o[2])):
        if point[1] <= hull[-1][1]:
            continue  # sheds no more than one already on it, for no fewer seconds
        while len(hull) > 1 and hull[-1][2] >= point[2]:
            hull.pop()  # sheds less for no fewer seconds
        while len(hull) >= 2 and _turns_up(hull[-2], hull[-1], point):
            hull.pop()
        hull.append(point)
    return hull


def _turns_up(a: tuple, b: tuple, c: tuple) -> bool:
    """Whether b lies above the line from a to c (b is not on the lower hull). On the line it
    stays: a finer step for the greedy, whose last step is what it may overshoot by."""
    return (b[2] - a[2]) * (c[1] - a[1]) > (c[2] - a[2]) * (b[1] - a[1])


def _slope(hull: list[tuple[str, float, float]], step: int) -> float:
    return (hull[step][2] - hull[step - 1][2]) / (hull[step][1] - hull[step - 1][1])


def _spread(layers: Sequence[LayerCost], modes: list[str]) -> list[str]:
    """Among interchangeable layers (same kind, bytes and seconds) any arrangement of the same
    modes costs the same: the whole-layer ones go to every (n/k)-th, so the plan is what
    transformers' `every_n_layers` would pick where it can; the selective ones fill in after
    them, each lever (and offloading) spread over the layers left."""
    out = list(modes)
    for members in _groups(layers).values():
        full = sum(modes[i] == FULL for i in members)
        spots = [members[(j * len(members)) // full] for j in range(full)] if full else []
        rest = [i for i in members if i not in spots]
        for i in members:
            out[i] = FULL if i in spots else PLAIN
        for lever in FILLED:
            count = sum(modes[i] == lever for i in members)
            taken = [rest[(j * len(rest)) // count] for j in range(count)] if count else []
            for i in taken:
                out[i] = lever
            rest = [i for i in rest if i not in taken]
    return out


def _groups(layers: Sequence[LayerCost]) -> dict[tuple, list[int]]:
    """Interchangeable layers: the same kind, bytes and seconds."""
    groups: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        key = (
            layer.kind,
            layer.plain,
            layer.checkpointed,
            layer.seconds,
            layer.kept,
            layer.kept_seconds,
            layer.attention,
            layer.attention_seconds,
            layer.offloaded,
            layer.offloaded_seconds,
            layer.feed_forward,
            layer.feed_forward_seconds,
        )
        groups.setdefault(key, []).append(i)
    return groups
