"""The interface every lever of the budget implements (gcpatch/step/levers/__init__.py holds the
registry), and the shares its pricing reads off the probed step's operators."""

from __future__ import annotations

from typing import Any

from gcpatch.step.bytes import Bytes
from gcpatch.step.probe import ALL, LayerFacts


class Lever:
    """One way to run a checkpointed layer. `below_whole`: it holds less than whole for more
    recompute (offloading) rather than sitting between plain and whole."""

    name = ""  # the glossary's word, in code, record keys, lines and docs
    title = ""  # in `gcpatch explain`: "keeping the matmuls"
    says = ""  # after a count of layers in the plan's line: "keeping their matmuls"
    brief = ""  # `says` where the line needs the room: "matmuls kept"
    idle = "saved nothing"  # after its title, where a step shows it did not fire
    below_whole = False

    def offered(self, layer: Any, func: Any, facts: LayerFacts, accelerator: bool) -> str | None:
        """Why the layer cannot run this way (None: it can)."""
        raise NotImplementedError

    def held(self, facts: LayerFacts) -> Bytes:
        """The bytes the layer holds this way, at the probed shape."""
        raise NotImplementedError

    def counted(self, facts: LayerFacts) -> float:
        """The share of a whole recompute's matmul FLOPs this way recomputes (torch's formulas)."""
        raise NotImplementedError

    def clocked(self, facts: LayerFacts, accelerator: bool) -> float:
        """The share of a whole recompute this way costs by the step's own operators: their
        seconds on a CPU, their count on an accelerator (whose kernels run asynchronously)."""
        return self.counted(facts)

    def wrap(self, func: Any, layer: Any) -> Any:
        """The layer's checkpoint function `func`, run this way."""
        raise NotImplementedError

    def fired(self, wrapped: Any) -> bool:
        """Whether the forwards run under `wrapped` did what this way promises."""
        return True

    def own(self, func: Any) -> Any | None:
        """The layer's own function where `func` is this lever's wrapper of it, else None."""
        return None


def share(facts: LayerFacts, part: str, accelerator: bool, key: str = ALL) -> float:
    """The share of the layer's operators in class `part` (or all but it, `key`='rest'), by
    their seconds on a CPU or their count on an accelerator."""
    flops, seconds, ops = facts.until_saved or (facts.flops, facts.seconds, facts.ops)
    table = ops if accelerator else seconds
    total = table.get(ALL, 0)
    if total <= 0:
        return 1.0
    value = table.get(part, 0)
    return max(0.0, (total - value if key == "rest" else value) / total)


def flop_share(facts: LayerFacts, part: str, rest: bool = False) -> float:
    """The share of the layer's matmul FLOPs in class `part` (or all but it)."""
    flops = facts.until_saved[0] if facts.until_saved else facts.flops
    total = flops.get(ALL, 0.0)
    if total <= 0:
        return 1.0
    value = flops.get(part, 0.0)
    return max(0.0, (total - value if rest else value) / total)
