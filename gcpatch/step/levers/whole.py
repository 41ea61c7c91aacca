"""Whole: the layer checkpointed as the framework enabled it, holding its inputs and recomputing
its forward in the backward."""

from __future__ import annotations

from typing import Any

from gcpatch.step.bytes import Bytes
from gcpatch.step.levers.lever import Lever
from gcpatch.step.probe import LayerFacts


class Whole(Lever):
    name = "whole"
    title = "checkpointing whole"
    says = "checkpointed whole"
    brief = "whole"

    def offered(self, layer: Any, func: Any, facts: LayerFacts, accelerator: bool) -> str | None:
        return None

    def held(self, facts: LayerFacts) -> Bytes:
        return facts.inputs

    def counted(self, facts: LayerFacts) -> float:
        return 1.0

    def wrap(self, func: Any, layer: Any) -> Any:
        return func


LEVER = Whole()
