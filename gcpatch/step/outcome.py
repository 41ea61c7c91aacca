"""What the budget did for one model: planned (the first plan, at its shape, from a cost model),
or skipped with the reason. Serialised only for the record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gcpatch.step.cost_model import CostModel
from gcpatch.step.solver import Plan


@dataclass
class Outcome:
    skipped: str | None = None
    plan: Plan | None = None
    shape: tuple[int, int] | None = None  # the shape the first plan is for
    costs: CostModel | None = None

    @property
    def planned(self) -> bool:
        return self.plan is not None

    @classmethod
    def skip(cls, why: str) -> Outcome:
        return cls(skipped=why)

    def to_record(self) -> dict[str, Any]:
        if self.plan is None:
            return {"skipped": self.skipped}
        costs = self.costs
        return {
            "plan": plan_dict(self.plan),
            "flags": self.plan.checkpoint,
            "shape": list(self.shape or ()),
            "measured": _measured(costs) if costs is not None else {},
        }


def _measured(costs: CostModel) -> dict[str, Any]:
    return {
        "shape": list(costs.shape),
        "outside_bytes": costs.outside.total,
        "layers": [
            {
                "kind": layer.kind,
                "held_bytes": {name: b.total for name, b in layer.held.items()},
                "baseline_bytes": layer.baseline.total,
                "recompute_s": layer.seconds,
                "shares": layer.shares,
                "counted": layer.counted,
                "refused": layer.refused,
            }
            for layer in costs.layers
        ],
    }


def plan_dict(found: Plan) -> dict:
    return {
        "modes": found.modes,
        "levers": found.counts(),
        "checkpointed": found.count,
        "layers": len(found.checkpoint),
        "limit_bytes": found.limit,
        "plain_bytes": found.baseline,
        "floor_bytes": found.floor,
        "planned_bytes": found.total,
        "recompute_s": found.recompute_s,
        "full_recompute_s": found.full_recompute_s,
        "every_n_layers": found.every_n_layers(),
        "below_floor": found.below_floor,
        "exact": found.exact,
    }
