"""Measuring what each checkpointable layer costs: the activation bytes it holds after the
forward, plain and checkpointed, and the seconds its recompute takes.

The instrument is `Held`: a torch dispatch mode that notes every storage an operator allocates
during a forward (views and in-place results share their input's storage and are skipped), and
which layer was running then. After the forward, with its graph kept and what it returned let
go, the storages still alive are exactly what the backward holds on to (saved tensors, checkpoint
inputs), each counted once however many tensors share it. A plain layer holds what it
allocated and is still alive; a checkpointed one holds only its outputs (the next layer's input,
which the plain layer also holds), so both are read from one plain forward. Bytes are measured
on one and on two rows of the batch and extrapolated linearly to the whole batch (a causal
mask or rotary table does not grow with it), so the measuring forward never needs the memory the
budget is there to avoid. Seconds are timed on a separate pass without the instrument, and
averaged over layers of one kind holding the same bytes (they run the same kernels; the first
one also pays warm-up).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from gcpatch.budget import LayerCost
from gcpatch.verify import _tensors

OUTSIDE = -1


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


class Held:
    """Counts the bytes a forward leaves alive, by the layer that allocated them (see the module
    docstring). Use as a context manager around the forward; read `alive()` while its output is
    still referenced."""

    def __init__(self, layers: list[Any] | None = None) -> None:
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode

        self._torch = torch
        self._weak = StorageWeakRef
        self.layers = list(layers or [])
        self.created: dict[
            int, tuple[Any, int, int]
        ] = {}  # storage key -> (weak ref, bytes, layer index)
        self.outputs: dict[int, set[int]] = {}  # layer index -> storage keys of its outputs
        self._stack = [OUTSIDE]
        self._handles: list[Any] = []
        held = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(
                self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
            ) -> Any:
                out = func(*args, **(kwargs or {}))
                held._note(args, kwargs, out)
                return out

        self._mode = _Mode()

    def __enter__(self) -> "Held":
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._enter_layer(index)))
            self._handles.append(
                layer.register_forward_hook(self._leave_layer(index), always_call=True)
            )
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()

    def alive(self, returned: Any = None) -> dict[int, int]:
        """Bytes still alive per allocating layer (OUTSIDE for the rest), leaving out the storages
        of `returned` (what the forward returned: held with or without checkpointing)."""
        skip = {self._key(t) for t in _tensors(self._torch, returned)}
        out: dict[int, int] = {}
        for key, (ref, nbytes, owner) in self.created.items():
            if key not in skip and not ref.expired():
                out[owner] = out.get(owner, 0) + nbytes
        return out

    def total(self, returned: Any = None) -> int:
        return sum(self.alive(returned).values())

    def outputs_alive(self, index: int) -> int:
        total = 0
        for key in self.outputs.get(index, ()):
            entry = self.created.get(key)
            if entry is not None and entry[2] == index and not entry[0].expired():
                total += entry[1]
        return total

    def _enter_layer(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            self._stack.append(index)

        return hook

    def _leave_layer(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self._stack[-1] == index:
                self._stack.pop()
            self.outputs.setdefault(index, set()).update(
                k for k in map(self._key, _tensors(self._torch, output)) if k
            )

        return hook

    def _key(self, tensor: Any) -> int | None:
        try:
            return int(tensor.untyped_storage()._cdata)
        except Exception:  # noqa: BLE001 (tensor subclasses without a storage: not counted)
            return None

    def _note(self, args: Any, kwargs: Any, out: Any) -> None:
        torch = self._torch
        inputs = {self._key(t) for t in _tensors(torch, (args, kwargs))}
        for tensor in _tensors(torch, out):
            key = self._key(tensor)
            if key is None or key in inputs:
                continue
            entry = self.created.get(key)
            if entry is not None and not entry[0].expired():
                continue
            try:
                storage = tensor.untyped_storage()
                self.created[key] = (self._weak(storage), int(storage.nbytes()), self._stack[-1])
            except Exception:  # noqa: BLE001 (not counted, like a storage-less subclass)
                continue


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
        graph = [t.grad_fn for t in _tensors(sys.modules["torch"], output) if t.grad_fn is not None]
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


@contextlib.contextmanager
def held_bytes() -> Iterator[Held]:
    """`with held_bytes() as held: out = model(...)`, then `held.total()`: the activation bytes
    that forward holds for its backward (benchmarks and tests measure plans with it)."""
    held = Held()
    with held:
        yield held
