"""Keep the matmuls: the outputs of `mm`, `addmm`, `bmm`, `baddbmm`, the grouped MoE matmuls and
the fused attention kernels saved, so the backward recomputes only the cheap work between them
(norms, activations, rotary, pointwise ops)."""

from __future__ import annotations

import sys
from typing import Any

from gcpatch.step.bytes import Bytes
from gcpatch.step.held import matmul_ops
from gcpatch.step.levers.lever import Lever, flop_share, share
from gcpatch.step.levers.policy import Keep, keeping, policy_of, selectable, without
from gcpatch.step.probe import MATMUL, LayerFacts


class KeepMatmuls(Lever):
    name = "keep-matmuls"
    title = "keeping the matmuls"
    says = "keeping their matmuls"
    brief = "matmuls kept"
    part = MATMUL

    def ops(self, torch: Any) -> frozenset:
        return matmul_ops(torch)

    def offered(self, layer: Any, func: Any, facts: LayerFacts, accelerator: bool) -> str | None:
        why = selectable(func)
        if why is None and self.part in facts.refused:
            why = f"refused: {facts.refused[self.part]}"
        if why is None and facts.kept.get(self.part, Bytes()).total <= 0:
            why = "the layer runs none of the operators it keeps"
        return why

    def held(self, facts: LayerFacts) -> Bytes:
        return facts.inputs + facts.kept.get(self.part, Bytes())

    def counted(self, facts: LayerFacts) -> float:
        return flop_share(facts, self.part, rest=True)

    def clocked(self, facts: LayerFacts, accelerator: bool) -> float:
        return share(facts, self.part, accelerator, key="rest")

    def wrap(self, func: Any, layer: Any) -> Any:
        return keeping(func, Keep(self.ops(sys.modules["torch"])))

    def fired(self, wrapped: Any) -> bool:
        policy = policy_of(wrapped)
        return policy is None or policy.kept > 0

    def own(self, func: Any) -> Any | None:
        policy = policy_of(func)
        if policy is None or policy.ops != self.ops(sys.modules["torch"]):
            return None
        return without(func)


LEVER = KeepMatmuls()
