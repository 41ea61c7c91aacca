"""The budget's lever below whole checkpointing: a layer checkpointed whole whose saved inputs wait
in host memory for its recompute, so the device holds neither its activations nor its inputs.

A checkpoint saves only its inputs (non-reentrant: through `save_for_backward` of a no-op function,
torch/utils/checkpoint.py `_NoopSaveInputs`; reentrant: `CheckpointFunction`'s own), so saved-tensor
hooks around the checkpoint call see exactly those and move each to pinned host memory, and back
before the recompute, as torch's own `save_on_cpu` does (transformers' `offload=True` wraps its
checkpoint in it). The copies cost time in the forward and the backward: offered only where the
layers run on an accelerator (on a CPU there is nowhere else to put them), and chosen only where
whole checkpointing cannot meet the budget for less (gcpatch/step/solver.py). Each wrapper counts
the bytes it moved, so a plan whose offloaded layer moved nothing falls back to whole checkpointing
(gcpatch/step/shapes.py).
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

from gcpatch.step.swap import CONTEXT_FN

log = logging.getLogger("gcpatch")


# the accelerators whose host memory torch pins (`torch.empty(..., pin_memory=True)`)
PINNED = ("cuda", "xpu")


def accelerator(module: Any) -> str | None:
    """The device type the module's parameters are on, where it is an accelerator whose host
    memory torch pins."""
    for param in module.parameters():
        kind = param.device.type
        return kind if kind in PINNED else None
    return None


def offered(func: Any) -> bool:
    """A layer's own checkpoint function (a partial of it, without a user's context_fn: a user's
    selective checkpointing stands as given)."""
    return isinstance(func, functools.partial) and CONTEXT_FN not in func.keywords


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


def own(func: Any) -> Any:
    """The layer's own checkpoint function where `func` is it offloaded."""
    return func.func if isinstance(func, Offload) else func
