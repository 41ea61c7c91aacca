"""What each checkpointable layer costs, measured: the activation bytes it holds after the forward,
plain and checkpointed, and the seconds its recompute takes.

A plain layer holds what it allocated and is still alive; a checkpointed one holds only its outputs
(the next layer's input, which the plain layer also holds), so both are read from one plain forward
counted by the instrument (gcpatch/step/held.py). Bytes are measured on one and on two rows of the
batch and extrapolated linearly to the whole batch (a causal mask or rotary table does not grow with
it), so the measuring forward never needs the memory the budget is there to avoid. Seconds are
timed on a separate pass without the instrument, and averaged over layers of one kind holding the
same bytes (they run the same kernels; the first one also pays warm-up).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gcpatch.step.batch import tensors
from gcpatch.step.held import OUTSIDE, Held
from gcpatch.step.solver import LayerCost


@dataclass
class Measured:
    """Per-layer costs extrapolated to the whole batch, and how they were measured."""

    layers: list[LayerCost]
    outside: float  # held by what runs outside the layers (embeddings, head, loss, masks)
    rows: list[int] = field(default_factory=list)
    batch: int = 0
    seconds: float = 0.0  # what measuring took

    @property
    def plain_total(self) -> float:
        return self.outside + sum(layer.plain for layer in self.layers)


def measure(
    model: Any, layers: list[Any], run: Callable[[int], Any], batch: int, kinds: list[str]
) -> Measured:
    """`run(rows)` runs `model`'s forward on the first `rows` rows with every layer plain and
    returns its output; the caller owns RNG, flags and hooks (gcpatch/planner.py)."""
    start = time.perf_counter()
    sizes = [1] if batch <= 1 else [1, 2]
    points = []
    for rows in sizes:
        held = Held(layers)
        with held:
            output = run(rows)
        # The graph stays, what the forward returned goes: the caller decides whether to keep its
        # logits, and they are held with or without checkpointing.
        graph = [t.grad_fn for t in tensors(sys.modules["torch"], output) if t.grad_fn is not None]
        del output
        alive = held.alive()
        points.append(
            (
                [alive.get(i, 0) for i in range(len(layers))],
                [held.outputs_alive(i) for i in range(len(layers))],
                alive.get(OUTSIDE, 0),
            )
        )
        del graph, held
    seconds = _time_layers(layers, lambda: run(sizes[-1]), _sync(model))
    plain, ckpt, outside = _extrapolate(points, sizes, batch)
    costs = [
        LayerCost(name=f"{i}", plain=p, checkpointed=min(c, p), seconds=s, kind=k)
        for i, (p, c, s, k) in enumerate(zip(plain, ckpt, seconds, kinds))
    ]
    return Measured(
        layers=_averaged(costs),
        outside=outside,
        rows=sizes,
        batch=batch,
        seconds=time.perf_counter() - start,
    )


def _extrapolate(
    points: list, sizes: list[int], batch: int
) -> tuple[list[float], list[float], float]:
    if len(points) == 1:
        ((plain, ckpt, outside),) = points
        return [float(v) for v in plain], [float(v) for v in ckpt], float(outside)
    (p1, c1, o1), (p2, c2, o2) = points
    scale = (batch - sizes[0]) / (sizes[1] - sizes[0])

    def line(a: float, b: float) -> float:
        return max(0.0, a + (b - a) * scale)

    return [line(a, b) for a, b in zip(p1, p2)], [line(a, b) for a, b in zip(c1, c2)], line(o1, o2)


def _averaged(costs: list[LayerCost]) -> list[LayerCost]:
    groups: dict[tuple, list[LayerCost]] = {}
    for cost in costs:
        groups.setdefault((cost.kind, cost.plain, cost.checkpointed), []).append(cost)
    mean = {key: sum(c.seconds for c in group) / len(group) for key, group in groups.items()}
    return [
        LayerCost(c.name, c.plain, c.checkpointed, mean[(c.kind, c.plain, c.checkpointed)], c.kind)
        for c in costs
    ]


def _time_layers(
    layers: list[Any], forward: Callable[[], Any], sync: Callable[[], None]
) -> list[float]:
    """Each layer's forward seconds, from a pass without gradients (a recompute runs the same
    kernels)."""
    import torch

    spent = [0.0] * len(layers)
    began: dict[int, float] = {}
    handles = []

    def enter(index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            sync()
            began[index] = time.perf_counter()

        return hook

    def leave(index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            sync()
            if index in began:
                spent[index] += time.perf_counter() - began.pop(index)

        return hook

    try:
        for index, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(enter(index)))
            handles.append(layer.register_forward_hook(leave(index), always_call=True))
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return spent


def _sync(model: Any) -> Callable[[], None]:
    torch = sys.modules["torch"]
    device = next((p.device for p in model.parameters()), None)
    if device is not None and device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
