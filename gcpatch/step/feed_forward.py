"""The budget's lever between plain and whole that asks nothing of each operator: a layer run plain
whose feed-forward block (its MLP, or its mixture-of-experts block) alone is checkpointed.

The block's activations (the MLP's up-projections and their activation, most of a decoder layer's
bytes where attention is a fused kernel) are dropped and made again in the backward; attention's
stay. Unlike the selective levers (gcpatch/step/selective.py) it runs no Python policy per op, so
on a device whose kernels are shorter than a Python call it costs what the block's recompute costs.

While the layer runs, the block's `forward` is one that checkpoints the original with the layer's
own checkpoint function (its use_reentrant and every other argument as decided); the recompute
calls the block again through its `__call__`, so its hooks run as they do in a whole layer's
recompute (a ZeRO-3 block gathers its parameters again). A `forward` another tool set on the block
(accelerate's hooks) is the one checkpointed, and is back afterwards. Each wrapper counts the
block calls it checkpointed, so a plan whose layer never called its block falls back to whole
checkpointing (gcpatch/step/shapes.py).
"""

from __future__ import annotations

from typing import Any, Callable

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


def own(func: Any) -> Any:
    """The layer's own checkpoint function where `func` is it around a feed-forward block."""
    return func.func if isinstance(func, FeedForward) else func
