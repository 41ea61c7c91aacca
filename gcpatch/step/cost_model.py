"""A budgeted model's costs at any batch shape, from the one step the probe read
(gcpatch/step/probe.py): per layer, the bytes it holds plain and under each lever it is offered,
what each lever's recompute costs as a share of whole's, and what the user's own job would hold
for it without checkpointing. Pure arithmetic, no torch.

A lever's share is the more of two readings of the step's own operators: its counted matmul FLOPs
against whole's (torch's formulas: no clock), and their seconds (on a CPU) or their count (on an
accelerator): a loaded clock can make a lever dearer, never cheaper than its FLOPs. Like layers
(one class, the same bytes) share one mean of their seconds and shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gcpatch.step import levers
from gcpatch.step.bytes import Bytes
from gcpatch.step.probe import ALL, Facts, LayerFacts
from gcpatch.step.solver import PLAIN, LayerCost

# why no lever but whole was offered where the user asked for whole layers alone
WHOLE_ASKED = "GCPATCH_BUDGET_LEVERS=whole asks for whole layers alone"


@dataclass
class LayerModel:
    """One layer at the probed shape."""

    kind: str
    held: dict[str, Bytes]  # plain, and each lever it is offered
    shares: dict[str, float]  # lever -> its recompute as a share of whole's
    counted: dict[str, float]  # lever -> its recompute's share of whole's matmul FLOPs
    seconds: float  # whole's recompute
    baseline: Bytes  # what the user's job holds for it without checkpointing
    refused: dict[str, str] = field(default_factory=dict)  # lever -> why not offered

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "held": {k: v.to_list() for k, v in self.held.items()},
            "shares": self.shares,
            "counted": self.counted,
            "seconds": self.seconds,
            "baseline": self.baseline.to_list(),
            "refused": self.refused,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerModel:
        return cls(
            kind=data["kind"],
            held={k: Bytes.from_list(v) for k, v in data["held"].items()},
            shares={k: float(v) for k, v in data["shares"].items()},
            counted={k: float(v) for k, v in data["counted"].items()},
            seconds=float(data["seconds"]),
            baseline=Bytes.from_list(data["baseline"]),
            refused=dict(data.get("refused") or {}),
        )


@dataclass
class CostModel:
    """Every layer, and what is held outside them, at the probed (rows, tokens)."""

    layers: list[LayerModel]
    outside: Bytes
    shape: tuple[int, int]
    calls: Bytes = field(default_factory=Bytes)  # held by checkpoints' calls (masks), not plainly

    def at(self, rows: int, tokens: int) -> tuple[list[LayerCost], float, float]:
        """The layers' costs at this shape (bytes held: the bound that errs towards more), what is
        held outside them, and the user's job without checkpointing (the bound towards less)."""
        r = rows / max(1, self.shape[0])
        t = tokens / max(1, self.shape[1])
        out = []
        for i, layer in enumerate(self.layers):
            plain = layer.held[PLAIN].at(r, t)
            held = {PLAIN: plain}
            for name, figure in layer.held.items():
                if name == PLAIN:
                    continue
                lever = levers.get(name)
                value = figure.at(r, t)
                held[name] = value if lever is not None and lever.below_whole else min(value, plain)
            seconds = layer.seconds * r * t
            cost = {name: seconds * share for name, share in layer.shares.items()}
            out.append(LayerCost(f"{i}", layer.kind, held, cost, dict(layer.counted)))
        outside = self.outside.at(r, t)
        baseline = self.outside.at(r, t, upper=False) + sum(
            layer.baseline.at(r, t, upper=False) for layer in self.layers
        )
        return out, outside, baseline

    def calls_at(self, rows: int, tokens: int) -> float:
        """What the checkpoints' calls hold at this shape while any layer is checkpointed."""
        return self.calls.at(rows / max(1, self.shape[0]), tokens / max(1, self.shape[1]))

    def drop(self, index: int, name: str, why: str) -> None:
        """Layer `index` no longer offers lever `name` (a step showed it did not fire)."""
        layer = self.layers[index]
        layer.held.pop(name, None)
        layer.shares.pop(name, None)
        layer.counted.pop(name, None)
        layer.refused[name] = why

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [layer.to_dict() for layer in self.layers],
            "outside": self.outside.to_list(),
            "shape": list(self.shape),
            "calls": self.calls.to_list(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        return cls(
            layers=[LayerModel.from_dict(d) for d in data["layers"]],
            outside=Bytes.from_list(data["outside"]),
            shape=(int(data["shape"][0]), int(data["shape"][1])),
            calls=Bytes.from_list(data.get("calls") or [0.0, 0.0]),
        )


def build(
    facts: Facts,
    layers: list[Any],
    funcs: list[Any],
    allowed: bool = True,
    untrained: int = 0,
) -> CostModel:
    """The cost model of `layers` (each under its own checkpoint function `funcs[i]`) from the
    probed step. `allowed`: levers besides whole may be offered (GCPATCH_BUDGET_LEVERS); the first
    `untrained` layers hold nothing in the user's own job without checkpointing (nothing before or
    in them trains: only gcpatch's input-grads hook gives them a graph)."""
    models = []
    for i, (layer, func, found) in enumerate(zip(layers, funcs, facts.layers)):
        held, shares, counted, refused = {PLAIN: found.operators}, {}, {}, {}
        for lever in levers.every():
            why = lever.offered(layer, func, found, facts.accelerator)
            if why is None and not allowed and lever is not levers.WHOLE:
                why = WHOLE_ASKED
            if why is not None:
                refused[lever.name] = why
                continue
            held[lever.name] = lever.held(found)
            counted[lever.name] = lever.counted(found)
            shares[lever.name] = max(counted[lever.name], lever.clocked(found, facts.accelerator))
        baseline = Bytes() if i < untrained else found.operators
        models.append(
            LayerModel(
                type(layer).__name__, held, shares, counted, _seconds(found), baseline, refused
            )
        )
    _mean_of_like(models)
    return CostModel(models, facts.outside, facts.shape, facts.calls)


def _seconds(found: LayerFacts) -> float:
    """Whole's recompute: timed in the backward, else the forward's operators (a step whose
    backward did not run), else its FLOPs as the unit (nothing was timed)."""
    return (
        found.recompute or found.seconds.get(ALL, 0.0) or found.flops.get(ALL, 0.0) * 1e-12 or 1e-9
    )


def _mean_of_like(models: list[LayerModel]) -> None:
    """Layers of one class holding the same bytes run the same kernels: one mean of their seconds
    and shares (each read on a clock; the first layer also paid the warm-up)."""
    groups: dict[tuple, list[LayerModel]] = {}
    for model in models:
        key = (
            model.kind,
            tuple(sorted((k, v.to_list()[0], v.to_list()[1]) for k, v in model.held.items())),
        )
        groups.setdefault(key, []).append(model)
    for members in groups.values():
        seconds = sum(m.seconds for m in members) / len(members)
        for m in members:
            m.seconds = seconds
        for name in members[0].shares:
            mean = sum(m.shares.get(name, 0.0) for m in members) / len(members)
            for m in members:
                m.shares[name] = mean
