"""Feed-forward: a layer run plain whose feed-forward block (its MLP, or its mixture-of-experts
block) alone is checkpointed. The block's activations are dropped and made again in the backward;
attention's stay. It runs no Python policy per operator (unlike gcpatch/step/levers/policy.py).

While the layer runs, the block's `forward` is one that checkpoints the original with the layer's
own checkpoint function (every argument as decided); the recompute calls the block again through
its `__call__`, so its hooks run as in a whole layer's recompute (a ZeRO-3 block gathers its
parameters again). A `forward` another tool set on the block (accelerate's hooks) is the one
checkpointed, and is back afterwards.
"""

from __future__ import annotations

from typing import Any, Callable

from gcpatch.step.bytes import Bytes
from gcpatch.step.levers.lever import Lever, flop_share, share
from gcpatch.step.levers.policy import selectable
from gcpatch.step.probe import BLOCK, LayerFacts

# the names a decoder layer gives its feed-forward block across transformers' families (Llama,
# Mistral, Qwen, Gemma, GPT-2, GPT-NeoX, Falcon, BLOOM, Mixtral 5.x: `mlp`; Mixtral 4.x:
# `block_sparse_moe`; others: `feed_forward`, `ffn`)
NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")


def block(layer: Any) -> Any:
    """The layer's feed-forward block: its direct child module by one of NAMES, or None."""
    children = getattr(layer, "_modules", None) or {}
    return next((children[name] for name in NAMES if children.get(name) is not None), None)


class FeedForward:
    """A layer's checkpoint function (`func`) that runs the layer plain with its feed-forward
    block checkpointed under `func`; counts the block calls it checkpointed (`ran`)."""

    def __init__(self, func: Callable[..., Any], block: Any) -> None:
        self.func, self.block = func, block
        self.ran = 0

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        block = self.block
        before = vars(block).get("forward")
        inner = block.forward

        def forward(*a: Any, **kw: Any) -> Any:
            self.ran += 1
            return self.func(run, *a, **kw)

        def run(*a: Any, **kw: Any) -> Any:
            if vars(block).get("forward") is forward:
                return inner(*a, **kw)  # the forward: inside the block's own call already
            return block(*a, **kw)  # the recompute: through its call, its hooks again

        block.forward = forward
        try:
            return function(*args, **kwargs)
        finally:
            if before is None:
                vars(block).pop("forward", None)
            else:
                block.forward = before


class Split(Lever):
    name = "feed-forward"
    title = "checkpointing the feed-forward block alone"
    says = "checkpointing their feed-forward block alone"
    brief = "MLP alone"
    idle = "saw no call of the block"

    def offered(self, layer: Any, func: Any, facts: LayerFacts, accelerator: bool) -> str | None:
        if block(layer) is None:
            return "the layer has no feed-forward block by a known name"
        return selectable(func) or facts.refused.get(BLOCK)

    def held(self, facts: LayerFacts) -> Bytes:
        return facts.operators - facts.block_only + facts.block_inputs

    def counted(self, facts: LayerFacts) -> float:
        return flop_share(facts, BLOCK)

    def clocked(self, facts: LayerFacts, accelerator: bool) -> float:
        return share(facts, BLOCK, accelerator)

    def wrap(self, func: Any, layer: Any) -> Any:
        return FeedForward(func, block(layer))

    def fired(self, wrapped: Any) -> bool:
        return not isinstance(wrapped, FeedForward) or wrapped.ran > 0

    def own(self, func: Any) -> Any | None:
        return func.func if isinstance(func, FeedForward) else None


LEVER = Split()
