"""The cheapest checkpointing plan that meets a memory budget: pure arithmetic, no torch.

A plan is a per-layer choice: a checkpointed layer holds only its outputs and costs its forward
again in the backward, a plain one holds every tensor its backward needs. Choosing the layers is a
0/1 knapsack (cover the bytes to shed at the least recompute), solved exactly over the Pareto front
of (bytes shed, recompute) and checked against exhaustive search in tests/unit/test_budget.py.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

from gcpatch.step import levers

PLAIN = "plain"
# Beyond this many Pareto points (distinct sums of bytes shed) the exact search is cut short, and
# the greedy over each layer's convex hull of options is taken instead (`_greedy_cover`: within one
# layer's recompute of the cheapest; the plan records it is not exact). Like layers give few points;
# layers that each hold other bytes (MoE layers routed differently) many.
MAX_FRONT = 2000
# Plans whose recompute is within this share of full checkpointing's of the cheapest are one
# price: among them the plan recomputing the fewest matmul FLOPs wins (`_fewest_matmuls`). A
# lever's seconds on a shared CPU move by more than this between runs (docs/BUDGET.md); its
# counted FLOPs do not.
SLACK = 0.15


def _whole() -> str:
    return levers.WHOLE.name


def _between(mode: str) -> bool:
    """A lever between plain and whole (not whole, not one below it)."""
    lever = levers.get(mode)
    return lever is not None and lever is not levers.WHOLE and not lever.below_whole


def search_text(exact: bool) -> str:
    """What a plan's line adds where the exact search was cut short (`MAX_FRONT`): the user reads
    that the plan is not the proven cheapest, and by how much it may miss."""
    if exact:
        return ""
    return " (greedy: within one layer's recompute of the cheapest)"


@dataclass
class LayerCost:
    """One checkpointable layer at one shape: the bytes it holds after the forward in each mode
    (plain, and each lever it is offered), what each adds to the backward (`cost`, seconds), and
    each lever's share of whole's matmul FLOPs (`counted`). `kind` groups interchangeable layers."""

    name: str
    kind: str
    held_by: dict[str, float]
    cost_by: dict[str, float]
    counted: dict[str, float] = field(default_factory=dict)

    @property
    def plain(self) -> float:
        return self.held_by[PLAIN]

    @property
    def seconds(self) -> float:
        """Whole's recompute."""
        return self.cost_by.get(_whole(), 0.0)

    @property
    def shed(self) -> float:
        return self.plain - self.held(_whole()) if _whole() in self.held_by else 0.0

    @property
    def least(self) -> float:
        """The fewest bytes the layer can hold, in any of its options."""
        return self.plain - max(shed for _, shed, _ in self.options())

    def fewest_mode(self) -> str:
        """The option holding the fewest bytes (a budget below the floor takes it)."""
        return max(self.options(), key=lambda option: (option[1], -option[2]))[0]

    def held(self, mode: str) -> float:
        """The bytes the layer holds after its forward in `mode`."""
        if mode == _whole():
            return min(self.plain, self.held_by.get(mode, self.plain))
        return self.held_by.get(mode) or 0.0

    def cost(self, mode: str) -> float:
        """What running the layer in `mode` adds to the backward, in seconds."""
        return 0.0 if mode == PLAIN else self.cost_by.get(mode, 0.0)

    def redone(self, mode: str) -> float:
        """The matmuls running in `mode` recomputes, in seconds of the layer's whole recompute:
        its counted FLOPs' share of whole's."""
        if mode == PLAIN:
            return 0.0
        return self.counted.get(mode, 1.0) * self.seconds

    def group_key(self) -> tuple:
        return (
            self.kind,
            tuple(sorted(self.held_by.items())),
            tuple(sorted(self.cost_by.items())),
            tuple(sorted(self.counted.items())),
        )

    def options(self) -> list[tuple[str, float, float]]:
        """(mode, bytes shed, seconds) of each useful way to run this layer, plain first: a lever
        between plain and whole where it holds less than plain for less than a whole recompute,
        one below whole where it holds less than whole."""
        out = [(PLAIN, 0.0, 0.0)]
        whole = _whole()
        for mode in self.held_by:
            if not _between(mode):
                continue
            if self.held(mode) < self.plain and self.cost(mode) < self.seconds:
                out.append((mode, self.plain - self.held(mode), self.cost(mode)))
        if whole in self.held_by and self.shed > 0:
            out.append((whole, self.shed, self.seconds))
        for mode in self.held_by:
            lever = levers.get(mode)
            if lever is not None and lever.below_whole and whole in self.held_by:
                if self.held(mode) < self.held(whole):
                    out.append((mode, self.plain - self.held(mode), self.cost(mode)))
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
    baseline: float = 0.0  # what the user's job holds at this shape without checkpointing

    @property
    def checkpoint(self) -> list[bool]:
        return [mode != PLAIN for mode in self.modes]

    @property
    def count(self) -> int:
        return sum(self.checkpoint)

    def counts(self) -> dict[str, int]:
        """How many layers run under each lever but whole."""
        out: dict[str, int] = {}
        for mode in self.modes:
            if mode not in (PLAIN, _whole()):
                out[mode] = out.get(mode, 0) + 1
        return out

    @property
    def below_floor(self) -> bool:
        return self.limit < self.floor

    def every_n_layers(self) -> int | None:
        """The `every_n_layers` of transformers' enable that expresses this plan (layer i
        checkpoints whole iff i % n == 0, no selective or offloaded layer), or None."""
        if any(mode not in (PLAIN, _whole()) for mode in self.modes):
            return None
        n_layers = len(self.modes)
        for n in range(1, n_layers + 1):
            if all(flag == (i % n == 0) for i, flag in enumerate(self.checkpoint)):
                return n
        return None


def solve(layers: Sequence[LayerCost], outside: float, limit: float, calls: float = 0.0) -> Plan:
    """The plan holding at most `limit` bytes with the least recompute (ties: fewer bytes held);
    a limit below the floor gives every layer its option holding the fewest bytes. Each layer's
    options (`LayerCost.options`) make it a multiple-choice knapsack, solved exactly over the
    Pareto front of (bytes shed, seconds). With levers between plain and whole, the plans within
    SLACK of full checkpointing's recompute of the cheapest are one price and the one recomputing
    the fewest matmul FLOPs wins. A lever priced no lower than its counted FLOPs
    (gcpatch/step/cost_model.py) so never makes a plan recompute more of them than the cheapest
    plan of whole layers alone: that plan is within the bound, or dearer than the one taken.
    `calls`: what the checkpoints' calls hold while any layer is checkpointed (a mask)."""
    plain_total = outside + sum(layer.plain for layer in layers)
    floor = outside + calls + sum(layer.least for layer in layers)
    full_s = sum(layer.seconds for layer in layers if layer.shed > 0)
    need = plain_total - limit if plain_total <= limit else plain_total + calls - limit
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
        elif any(_between(mode) for layer in layers for mode, _, _ in layer.options()):
            cheapest = sum(layers[i].cost(mode) for i, mode in found)
            found = _fewest_matmuls(layers, need, cheapest + SLACK * full_s) or found
        for i, mode in found:
            modes[i] = mode
        modes = _spread(layers, modes)
    return Plan(
        modes=modes,
        limit=limit,
        plain_total=plain_total,
        floor=floor,
        total=_held(layers, outside, calls, modes),
        recompute_s=_recompute(layers, modes),
        full_recompute_s=full_s,
        exact=exact,
        names=[layer.name for layer in layers],
    )


def _held(layers: Sequence[LayerCost], outside: float, calls: float, modes: list[str]) -> float:
    total = outside + sum(layer.held(mode) for layer, mode in zip(layers, modes))
    return total + (calls if any(mode != PLAIN for mode in modes) else 0.0)


def _recompute(layers: Sequence[LayerCost], modes: list[str]) -> float:
    return sum(layer.cost(mode) for layer, mode in zip(layers, modes))


def with_modes(
    plan: Plan, layers: Sequence[LayerCost], outside: float, calls: float, modes: list[str]
) -> Plan:
    """`plan` with other modes (the ranks' agreed ones under ZeRO-3), its bytes and recompute
    those modes' own, so that what is said and recorded is what runs."""
    return replace(
        plan,
        modes=modes,
        total=_held(layers, outside, calls, modes),
        recompute_s=_recompute(layers, modes),
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
    whose matmul recompute (`LayerCost.redone`) is least (ties: fewer seconds). Like layers are
    one group (`_groups`), chosen by how many of them run in each mode (`_mixes`, undominated
    only); between groups only the states no other shedding as much beats on seconds and matmul
    recompute at once (`_undominated`). None when they outgrow MAX_FRONT."""
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
    whole = _whole()
    filled = [lever.name for lever in levers.every() if lever is not levers.WHOLE]
    for members in _groups(layers).values():
        full = sum(modes[i] == whole for i in members)
        spots = [members[(j * len(members)) // full] for j in range(full)] if full else []
        rest = [i for i in members if i not in spots]
        for i in members:
            out[i] = whole if i in spots else PLAIN
        for lever in filled:
            count = sum(modes[i] == lever for i in members)
            taken = [rest[(j * len(rest)) // count] for j in range(count)] if count else []
            for i in taken:
                out[i] = lever
            rest = [i for i in rest if i not in taken]
    return out


def _groups(layers: Sequence[LayerCost]) -> dict[tuple, list[int]]:
    """Interchangeable layers: the same kind, bytes, seconds and counted FLOPs."""
    groups: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        groups.setdefault(layer.group_key(), []).append(i)
    return groups
