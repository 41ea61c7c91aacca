"""The instrument of the memory budget: the activation bytes a forward leaves alive for its
backward, by the layer that allocated them.

`Held` is a torch dispatch mode that notes every storage an operator allocates during a forward
(views and in-place results share their input's storage and are skipped), and which layer was
running then. After the forward, with its graph kept and what it returned let go, the storages
still alive are exactly what the backward holds on to (saved tensors, checkpoint inputs), each
counted once however many tensors share it. No saved-tensor hooks: what is counted is what the
allocator holds. Given each layer's feed-forward block, it also notes what the block's calls made,
took and returned, and whether one wrote into a tensor it was given: what checkpointing the block
alone would shed (gcpatch/step/feed_forward.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from gcpatch.step.batch import tensors

OUTSIDE = -1  # bytes allocated outside every layer (embeddings, head, loss, masks)


class Held:
    """Counts the bytes a forward leaves alive, by the layer that allocated them (see the module
    docstring); with `device_only`, on the accelerator alone. Use as a context manager around the
    forward; read `alive()` while its output is still referenced."""

    def __init__(
        self,
        layers: list[Any] | None = None,
        device_only: bool = False,
        savers: bool = False,
        blocks: list[Any] | None = None,
    ) -> None:
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
        # layer index -> its tensor inputs this forward made: storage key -> (weak ref, bytes)
        self.inputs: dict[int, dict[int, tuple[Any, int]]] = {}
        # layer index -> bytes its matrix multiplies and attention kernels produced (alive or not):
        # what a selective checkpoint that keeps them (gcpatch/step/selective.py) holds besides
        # the layer's outputs
        self.matmul: dict[int, int] = {}
        # the same for the fused attention kernels alone (what keeping the attention output holds)
        self.attention: dict[int, int] = {}
        self._matmuls = matmul_ops(torch)
        self._attention = attention_ops(torch)
        self._stack = [OUTSIDE]
        # on an accelerator, its memory alone: host copies (offloaded inputs) are not the budget's
        self._device_only = device_only
        # storage key -> the layers (OUTSIDE for none) whose operators saved it for the backward:
        # read through saved-tensor hooks that change nothing, only with `savers` (a measuring
        # forward of gcpatch's own, whose graph is thrown away: a user's hooks are not displaced)
        self.saved_by: dict[int, set[int]] = {}
        self._savers = (
            torch.autograd.graph.saved_tensors_hooks(self._saved, _unpacked) if savers else None
        )
        # each layer's feed-forward block (None: none offered), and what its calls made, took and
        # returned: storage keys, and the inputs' (weak ref, bytes) while they were alive
        self.blocks = list(blocks or [])
        self.block_made: dict[int, set[int]] = {}
        self.block_inputs: dict[int, dict[int, tuple[Any, int]]] = {}
        self.block_outputs: dict[int, set[int]] = {}
        # the layers whose block wrote into a tensor it was given (Mixtral's router jitter
        # multiplies its input in place): checkpointed alone, its saved input would have changed
        # by the recompute, which autograd refuses
        self.block_wrote: set[int] = set()
        self._versions: list[list[tuple[Any, int]]] = []
        self._in_block: list[int] = []
        self._handles: list[Any] = []
        held = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(
                self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
            ) -> Any:
                out = func(*args, **(kwargs or {}))
                held._note(args, kwargs, out, func)
                return out

        self._mode = _Mode()

    def __enter__(self) -> "Held":
        for index, layer in enumerate(self.layers):
            self._handles.append(
                layer.register_forward_pre_hook(self._enter_layer(index), with_kwargs=True)
            )
            self._handles.append(
                layer.register_forward_hook(self._leave_layer(index), always_call=True)
            )
        for index, block in enumerate(self.blocks):
            if block is not None:
                self._handles.append(
                    block.register_forward_pre_hook(self._enter_block(index), with_kwargs=True)
                )
                self._handles.append(
                    block.register_forward_hook(self._leave_block(index), always_call=True)
                )
        self._mode.__enter__()
        if self._savers is not None:
            self._savers.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._savers is not None:
                self._savers.__exit__(*exc)
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

    def checkpointed(self, index: int) -> int:
        """What the layer holds checkpointed whole, read from a plain forward: its outputs still
        alive (the next layer holds them either way), and the inputs this forward made, for this
        layer alone, that died in it (a checkpoint keeps them: the first op of a bf16 layer's
        RMSNorm saves an fp32 copy, not the input itself). An input several layers take (a
        padding mask that eager attention adds and does not save) is held once whichever of them
        is checkpointed, which no one layer's figure can say: it is left out, as before inputs
        were counted at all."""
        outputs = self.outputs.get(index, set())
        total = 0
        for key in outputs:
            entry = self.created.get(key)
            if entry is not None and entry[2] == index and not entry[0].expired():
                total += entry[1]
        died = (nbytes for ref, nbytes in self._own_inputs(index).values() if ref.expired())
        return total + sum(died)

    def offloaded(self, index: int) -> int:
        """What the layer holds checkpointed whole with its inputs offloaded
        (gcpatch/step/offload.py), from a forward counted with `savers`: `checkpointed` less the
        inputs made for this layer alone that no operator outside it saved, which then wait in
        host memory. Where such an input was alive after the plain forward it is in the figure of
        the layer (or the outside) that made it, so the figures of a stack sum to what it holds
        (every layer's output less its input: the last output less the first input) and one
        figure may be below its outputs. An input the layer before saves itself (a ReLU saves its
        output) stays on the device while that layer runs plain, and so does an input several
        layers take: neither is taken off."""
        moved = sum(
            nbytes
            for key, (_, nbytes) in self._own_inputs(index).items()
            if self.saved_by.get(key, set()) <= {index}
        )
        return self.checkpointed(index) - moved

    def feed_forward_shed(self, index: int) -> int | None:
        """What checkpointing the layer's feed-forward block alone sheds from its plain bytes
        (gcpatch/step/feed_forward.py): what the block made that is still alive, less its
        outputs (what outside it saves stays saved), less its inputs that died (the checkpoint
        keeps them). None where the block did not run in the forward, or wrote into its input."""
        if index not in self.block_inputs or index in self.block_wrote:
            return None
        outputs = self.block_outputs.get(index, set())
        made = 0
        for key in self.block_made.get(index, set()) - outputs:
            entry = self.created.get(key)
            if entry is not None and entry[2] == index and not entry[0].expired():
                made += entry[1]
        died = sum(n for ref, n in self.block_inputs[index].values() if ref.expired())
        return made - died

    def _own_inputs(self, index: int) -> dict[int, tuple[Any, int]]:
        """Storage key -> (weak ref, bytes) of the inputs this forward made for this layer alone
        (not also one of its outputs, nor another layer's input)."""
        outputs = self.outputs.get(index, set())
        shared = {key for i, made in self.inputs.items() if i != index for key in made}
        return {
            key: entry
            for key, entry in self.inputs.get(index, {}).items()
            if key not in outputs and key not in shared
        }

    def _saved(self, tensor: Any) -> Any:
        key = self._key(tensor)
        if key is not None:
            self.saved_by.setdefault(key, set()).add(self._stack[-1])
        if tensor.grad_fn is None:
            # a leaf (a parameter) as autograd saves it: the tensor itself, so a framework that
            # swaps a parameter's data out (DeepSpeed ZeRO-3 after its gather) frees the old one
            return tensor
        # detached: the same storage, held as long as autograd would, without the reference to
        # its grad_fn a saved output would then make from its own node (a cycle that outlives the
        # measuring forward until the garbage collector runs, counted by the step around it)
        return tensor.detach()

    def _enter_layer(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            self._stack.append(index)
            given = tensors(self._torch, (args, kwargs))
            self.inputs.setdefault(index, {}).update(self._made_here(given))

        return hook

    def _made_here(self, given: Any) -> dict[int, tuple[Any, int]]:
        """Storage key -> (weak ref, bytes) of the tensors in `given` that this forward made and
        are alive, read at the call: a freed storage's key can come again."""
        out = {}
        for key in map(self._key, given):
            entry = self.created.get(key)
            if entry is not None and not entry[0].expired():
                out[key] = (entry[0], entry[1])
        return out

    def _leave_layer(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self._stack[-1] == index:
                self._stack.pop()
            self.outputs.setdefault(index, set()).update(
                k for k in map(self._key, tensors(self._torch, output)) if k
            )

        return hook

    def _enter_block(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            self._in_block.append(index)
            given = list(tensors(self._torch, (args, kwargs)))
            self._versions.append([(t, _version(t)) for t in given])
            self.block_inputs.setdefault(index, {}).update(self._made_here(given))

        return hook

    def _leave_block(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self._in_block and self._in_block[-1] == index:
                self._in_block.pop()
                if any(_version(t) != v for t, v in self._versions.pop()):
                    self.block_wrote.add(index)
            self.block_outputs.setdefault(index, set()).update(
                k for k in map(self._key, tensors(self._torch, output)) if k
            )

        return hook

    def _key(self, tensor: Any) -> int | None:
        try:
            return int(tensor.untyped_storage()._cdata)
        except Exception:  # noqa: BLE001 (tensor subclasses without a storage: not counted)
            return None

    def _note(self, args: Any, kwargs: Any, out: Any, func: Any = None) -> None:
        torch = self._torch
        matmul, attention = func in self._matmuls, func in self._attention
        inputs = {self._key(t) for t in tensors(torch, (args, kwargs))}
        for tensor in tensors(torch, out):
            key = self._key(tensor)
            if key is None or key in inputs or (self._device_only and tensor.device.type == "cpu"):
                continue
            entry = self.created.get(key)
            if entry is not None and not entry[0].expired():
                continue
            try:
                storage = tensor.untyped_storage()
                nbytes, owner = int(storage.nbytes()), self._stack[-1]
                self.created[key] = (self._weak(storage), nbytes, owner)
            except Exception:  # noqa: BLE001 (not counted, like a storage-less subclass)
                continue
            if self._in_block and self._in_block[-1] == owner:
                self.block_made.setdefault(owner, set()).add(key)
            else:  # a freed storage's key come again outside the block
                self.block_made.get(owner, set()).discard(key)
            if matmul:
                self.matmul[owner] = self.matmul.get(owner, 0) + nbytes
            if attention:
                self.attention[owner] = self.attention.get(owner, 0) + nbytes


def _unpacked(tensor: Any) -> Any:
    return tensor


def _version(tensor: Any) -> int | None:
    """Its version counter (bumped by every in-place write), or None where it keeps none (an
    inference tensor)."""
    try:
        return int(tensor._version)
    except Exception:  # noqa: BLE001 (no counter: no write seen)
        return None


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
