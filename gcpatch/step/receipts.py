"""GCPATCH_VERIFY=1 under a memory budget: each new shape's step counted against its plan. The
bytes its forward really held go to the record beside what was planned; a step more than
TOLERANCE over its plan is planned again for that shape, tighter by what it overshot, with one
line."""

from __future__ import annotations

import logging
from typing import Any

from gcpatch import budget as budget_mod
from gcpatch import headline, record, settings
from gcpatch.ranks import rank
from gcpatch.step.held import Held
from gcpatch.step.outcome import plan_dict
from gcpatch.step.solver import Plan

log = logging.getLogger("gcpatch")
TOLERANCE = 0.05
MAX_RECEIPTS = 64  # new shapes counted, per model


class Receipts:
    """Counts the first step of each new shape (`start` before its forward, `done` after)."""

    def __init__(self, name: str, device_only: bool) -> None:
        self.name, self.device_only = name, device_only
        self.counting: tuple[tuple, Plan, Held] | None = None
        self.given = 0

    def start(self, key: tuple, plan: Plan) -> None:
        if self.counting is not None or self.given >= MAX_RECEIPTS:
            return
        self.given += 1
        held = Held(device_only=self.device_only)
        held.__enter__()
        self.counting = (key, plan, held)

    def done(self, output: Any) -> tuple[tuple, float] | None:
        """(shape key, held over planned) where the step held more than its plan allows."""
        if self.counting is None:
            return None
        key, plan, held = self.counting
        self.counting = None
        held.__exit__(None, None, None)
        if output is None:
            return None  # the forward raised: nothing to count
        total = float(held.total(returned=output))
        over = total > max(plan.total, plan.limit) * (1 + TOLERANCE)
        size = budget_mod.size
        line = (
            f"gcpatch: rank {rank()} budget {self.name}: {key[0]} x {key[1]} tokens held"
            f" {size(total)} against {size(plan.total)} planned"
            + ("; planned again for that shape, tighter" if over else "")
        )
        log.log(logging.WARNING if over else logging.DEBUG, "%s", headline.wrap(line))
        record.event(
            {
                "stage": "budget-receipt",
                "model": self.name,
                "line": line,
                "shape": list(key[:2]),
                "held_bytes": total,
                "plan": plan_dict(plan),
            },
            settings.read().record_dir,
        )
        return (key, total / max(plan.total, 1.0)) if over else None
