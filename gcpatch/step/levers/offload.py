"""Offload: a layer checkpointed whole whose saved inputs wait in host memory for its recompute, so
the device holds neither its activations nor its inputs.

A checkpoint saves only its inputs (non-reentrant: through `save_for_backward` of a no-op
function, torch/utils/checkpoint.py `_NoopSaveInputs`; reentrant: `CheckpointFunction`'s own), so
saved-tensor hooks around the checkpoint call see exactly those and move each to pinned host
memory, and back before the recompute, as torch's own `save_on_cpu` does. Offered only on an
accelerator (on a CPU there is nowhere else to put them); the copies cost more than whole's
recompute (COPIES), so it is chosen only where whole cannot meet the budget.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

from gcpatch.step.bytes import Bytes
from gcpatch.step.levers.lever import Lever
from gcpatch.step.levers.policy import CONTEXT_FN
from gcpatch.step.probe import LayerFacts

# what the copies add to a whole recompute, as its share: a lever below whole costs more than it
COPIES = 0.25
log = logging.getLogger("gcpatch")


# the accelerators whose host memory torch pins (`torch.empty(..., pin_memory=True)`)
PINNED = ("cuda", "xpu")


def accelerator_of(module: Any) -> str | None:
    """The device type the module's parameters are on, where it is an accelerator whose host
    memory torch pins."""
    for param in module.parameters():
        kind = param.device.type
        return kind if kind in PINNED else None
    return None


def _on_host(tensor: Any) -> bool:
    return tensor.device.type == "cpu"


def _to_pinned(tensor: Any) -> Any:
    torch = sys.modules["torch"]
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
    host.copy_(tensor)
    return host


def _to_device(host: Any, device: Any) -> Any:
    return host.to(device, non_blocking=True)


class Offload:
    """A layer's checkpoint function (`func`) whose saved tensors go to host memory
    (`to_host(tensor)`, back with `to_device(host, device)`: a pinned copy by default); counts
    the bytes its forwards moved (`moved`)."""

    def __init__(
        self,
        func: Callable[..., Any],
        to_host: Callable[[Any], Any] | None = None,
        to_device: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        self.func = func
        self.to_host, self.to_device = to_host, to_device
        self.moved = 0
        self.failed: str | None = None  # why a copy to the host failed (the tensor stayed)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        torch = sys.modules["torch"]
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.func(*args, **kwargs)

    def _pack(self, tensor: Any) -> Any:
        if self.to_host is None and _on_host(tensor):
            return (None, tensor)  # on the host already
        try:
            host = (self.to_host or _to_pinned)(tensor)
        except Exception as exc:  # noqa: BLE001 (fail open: the tensor stays where it is)
            if self.failed is None:
                self.failed = f"{type(exc).__name__}: {exc}"
                # the user's line comes from the plan's check (gcpatch/step/shapes.py `fired`),
                # once for every layer that moved nothing
                log.debug("gcpatch: offloading a checkpoint's input failed (%s)", self.failed)
            return (None, tensor)
        self.moved += tensor.untyped_storage().nbytes()
        return (tensor.device, host)

    def _unpack(self, packed: tuple) -> Any:
        device, held = packed
        return held if device is None else (self.to_device or _to_device)(held, device)


class Offloading(Lever):
    name = "offload-inputs"
    title = "offloading the inputs"
    says = "offloading their inputs"
    brief = "offloaded"
    idle = "moved nothing"
    below_whole = True

    def offered(self, layer: Any, func: Any, facts: LayerFacts, accelerator: bool) -> str | None:
        if not accelerator or accelerator_of(layer) is None:
            return "the layers run on no accelerator: there is nowhere else to put their inputs"
        if not isinstance(func, functools.partial) or CONTEXT_FN in func.keywords:
            return "the user's own context_fn stands as given"
        return None

    def held(self, facts: LayerFacts) -> Bytes:
        return Bytes()  # its inputs wait in host memory

    def counted(self, facts: LayerFacts) -> float:
        return 1.0

    def clocked(self, facts: LayerFacts, accelerator: bool) -> float:
        return 1.0 + COPIES

    def wrap(self, func: Any, layer: Any) -> Any:
        return Offload(func)

    def fired(self, wrapped: Any) -> bool:
        return not isinstance(wrapped, Offload) or wrapped.moved > 0

    def own(self, func: Any) -> Any | None:
        return func.func if isinstance(func, Offload) else None


LEVER = Offloading()
