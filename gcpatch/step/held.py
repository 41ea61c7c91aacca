"""The instrument of the bytes a forward leaves alive for its backward, by the layer that allocated
them: what GCPATCH_VERIFY=1 counts on the first step with a plan in place, and what tests and
benchmarks measure plans with.

`Held` is a torch dispatch mode that notes every storage an operator allocates during a forward
(views and in-place results share their input's storage and are skipped), and which layer was
running then. After the forward, with its graph kept and what it returned let go, the storages
still alive are exactly what the backward holds on to (saved tensors, checkpoint inputs), each
counted once however many tensors share it. No saved-tensor hooks: what is counted is what the
allocator holds.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from gcpatch.step.batch import tensors

OUTSIDE = -1  # bytes allocated outside every layer (embeddings, head, loss, masks)


class Held:
    """Counts the bytes a forward leaves alive, by the layer that allocated them; with
    `device_only`, on the accelerator alone. Use as a context manager around the forward; read
    `alive()` while its output is still referenced."""

    def __init__(self, layers: list[Any] | None = None, device_only: bool = False) -> None:
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode

        self._torch = torch
        self._weak = StorageWeakRef
        self.layers = list(layers or [])
        # storage key -> (weak ref, bytes, layer index)
        self.created: dict[int, tuple[Any, int, int]] = {}
        self._stack = [OUTSIDE]
        # on an accelerator, its memory alone: host copies (offloaded inputs) are not the budget's
        self._device_only = device_only
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
        skip = {self._key(t) for t in tensors(self._torch, returned)}
        out: dict[int, int] = {}
        for key, (ref, nbytes, owner) in self.created.items():
            if key not in skip and not ref.expired():
                out[owner] = out.get(owner, 0) + nbytes
        return out

    def total(self, returned: Any = None) -> int:
        return sum(self.alive(returned).values())

    def _enter_layer(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            self._stack.append(index)

        return hook

    def _leave_layer(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self._stack[-1] == index:
                self._stack.pop()

        return hook

    def _key(self, tensor: Any) -> int | None:
        try:
            return int(tensor.untyped_storage()._cdata)
        except Exception:  # noqa: BLE001 (tensor subclasses without a storage: not counted)
            return None

    def _note(self, args: Any, kwargs: Any, out: Any) -> None:
        inputs = {self._key(t) for t in tensors(self._torch, (args, kwargs))}
        for tensor in tensors(self._torch, out):
            key = self._key(tensor)
            if key is None or key in inputs or (self._device_only and tensor.device.type == "cpu"):
                continue
            entry = self.created.get(key)
            if entry is not None and not entry[0].expired():
                continue
            try:
                storage = tensor.untyped_storage()
                self.created[key] = (self._weak(storage), int(storage.nbytes()), self._stack[-1])
            except Exception:  # noqa: BLE001 (not counted, like a storage-less subclass)
                continue


@contextlib.contextmanager
def held_bytes(device_only: bool = False) -> Iterator[Held]:
    """`with held_bytes() as held: out = model(...)`, then `held.total()`: the activation bytes
    that forward holds for its backward (benchmarks and tests measure plans with it); with
    `device_only`, on an accelerator alone (offloaded inputs wait in host memory)."""
    held = Held(device_only=device_only)
    with held:
        yield held


def matmul_ops(torch: Any) -> frozenset:
    """The matrix multiplies and fused attention kernels as the dispatcher sees them (their
    `.default` overloads: a policy that names the packet, `aten.mm`, matches nothing,
    pytorch/pytorch#176065): the work a selective checkpoint keeps instead of recomputing. The
    grouped ones are MoE experts' (transformers' `grouped_mm` experts implementation,
    transformers/integrations/moe.py: `aten._grouped_mm`, or its own `grouped_mm_fallback` op
    where torch's has no kernel), most of such a layer's matmul work."""
    grouped = _overloads(torch, ("_grouped_mm",))
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if hasattr(fallback, "default"):
        grouped |= {fallback.default}
    return _overloads(torch, ("mm", "addmm", "bmm", "baddbmm")) | grouped | attention_ops(torch)


def attention_ops(torch: Any) -> frozenset:
    """The fused scaled-dot-product attention kernels (flash, CPU flash, memory-efficient, cuDNN),
    `.default` overloads; unfused attention runs as matmuls, softmax and dropout instead."""
    return _overloads(
        torch,
        (
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
        ),
    )


def _overloads(torch: Any, names: tuple[str, ...]) -> frozenset:
    aten = torch.ops.aten
    return frozenset(
        getattr(aten, name).default
        for name in names
        if hasattr(getattr(aten, name, None), "default")
    )
