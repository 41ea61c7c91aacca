"""The memory budget's instrument: what the job's own first training step shows of each checkpointed
layer, read from within that step. Nothing of the user's runs again, nothing another thread sees.

Around each layer's checkpoint call, saved-tensor hooks that hand every tensor on to the hooks
beneath them (checkpointing's own, or the user's) note what autograd saves, and for whom: the
checkpoint (its inputs: what the layer holds whole), the layer's operators (what it holds plain),
its feed-forward block's. Inside the layer's forward a dispatch mode of this thread notes its
matmuls' and attention kernels' outputs, their FLOPs, and each operator class's seconds (on a
CPU); the backward's recompute of each layer is timed. Reentrant checkpointing saves nothing in
its forward: its layers' saves are read in their recompute.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from torch.utils._python_dispatch import TorchDispatchMode

from gcpatch.step.batch import tensors
from gcpatch.step.bytes import EITHER, LINEAR, SQUARE, Bytes
from gcpatch.step.held import attention_ops, matmul_ops

log = logging.getLogger("gcpatch")
OUTSIDE = -1
FUNC = "_gradient_checkpointing_func"
# who saved a tensor: the checkpoint of a layer, its operators, its feed-forward block's; and who
# holds one without saving it: a checkpoint's call (its keyword tensors, a mask, wait with it)
CHECKPOINT, OPERATORS, BLOCK, CALL = "checkpoint", "operators", "block", "call"
# the operator classes a lever keeps or recomputes
ALL, MATMUL, ATTENTION = "all", "matmul", "attention"


@dataclass
class LayerFacts:
    """One layer at the probed shape: the bytes each part of it saved, what its operators did."""

    operators: Bytes = field(default_factory=Bytes)  # what its operators save (not shared)
    inputs: Bytes = field(default_factory=Bytes)  # what its checkpoint saves
    block_only: Bytes = field(default_factory=Bytes)  # saved by its feed-forward block alone
    block_inputs: Bytes = field(default_factory=Bytes)  # its block's inputs nothing else saves
    kept: dict[str, Bytes] = field(default_factory=dict)  # MATMUL / ATTENTION: outputs made
    flops: dict[str, float] = field(default_factory=dict)  # ALL, MATMUL, ATTENTION, BLOCK
    seconds: dict[str, float] = field(default_factory=dict)  # forward operators' (CPU only)
    ops: dict[str, int] = field(default_factory=dict)  # operator counts
    recompute: float = 0.0  # the backward's recompute, seconds
    saved: bool = False  # its operators' saves were seen (the forward, or a reentrant recompute)
    # (flops, seconds, ops) of the forward's operators before its last save: what a recompute
    # that stops there runs (none: the whole forward, as a reentrant recompute runs it)
    until_saved: tuple[dict, dict, dict] | None = None
    block_ran: bool = False
    refused: dict[str, str] = field(default_factory=dict)  # what a lever cannot do here, and why


@dataclass
class Facts:
    """What the probed step showed: per layer, outside the layers, and the shape it ran at."""

    layers: list[LayerFacts]
    outside: Bytes
    shape: tuple[int, int]
    accelerator: bool
    calls: Bytes = field(default_factory=Bytes)  # held by the checkpoints' calls, not plainly

    @property
    def complete(self) -> bool:
        return all(layer.saved for layer in self.layers)


class Probe:
    """Instruments one training step of `layers` (checkpointed, each under its own checkpoint
    function) at `shape` (rows, tokens); `blocks`: each layer's feed-forward block, or None."""

    def __init__(
        self, layers: list[Any], blocks: list[Any], shape: tuple[int, int], accelerator: bool
    ) -> None:
        torch = sys.modules["torch"]
        self.torch, self.layers, self.blocks = torch, layers, blocks
        self.shape, self.accelerator = shape, accelerator
        self.thread = threading.get_ident()
        # a weight's sizes (a ZeRO-3 partition's as gathered, `ds_shape`)
        self.sizes = {
            size for m in layers for p in m.parameters() for size in getattr(p, "ds_shape", p.shape)
        }
        self.owner: list[tuple[str, int]] = [(OPERATORS, OUTSIDE)]
        self.entries: list[_Entry] = []
        # storage key -> (weak reference, its entry) while the storage lives: a freed storage's
        # key comes again for another
        self.live: dict[int, tuple[Any, _Entry]] = {}
        self.layer_facts = [LayerFacts() for _ in layers]
        self.made: dict[int, dict[str, dict[int, Any]]] = {}  # layer -> class -> key -> weak ref
        self.recomputing = False
        self.versions: list[list[tuple[Any, int | None]]] = []  # the open blocks' inputs
        self.matmuls, self.attention = matmul_ops(torch), attention_ops(torch)
        self.flop_formulas = _flop_formulas()
        self.handles: list[Any] = []
        self.funcs: list[tuple[Any, Any]] = []
        self.outer: Any = None
        self.failed: str | None = None

    # -- installing and taking off

    def start(self) -> None:
        """Before the step's forward: each layer's checkpoint function probed, the block hooks on,
        the saves outside the layers noted."""
        for index, layer in enumerate(self.layers):
            own = vars(layer).get(FUNC)
            probed = _Probed(getattr(layer, FUNC, None), self, index, own is not None)
            self.funcs.append((layer, probed))
            setattr(layer, FUNC, probed)
        for index, block in enumerate(self.blocks):
            if block is not None:
                self.handles.append(block.register_forward_pre_hook(self._enter_block(index)))
                self.handles.append(
                    block.register_forward_hook(self._leave_block(index), always_call=True)
                )
        self.outer = self.entered(OPERATORS, OUTSIDE)

    def forward_done(self) -> None:
        """The step's forward returned: the saves outside the layers are complete."""
        if self.outer is not None:
            outer, self.outer = self.outer, None
            try:
                outer.__exit__(None, None, None)
            except Exception as exc:  # noqa: BLE001 (hooks the forward left unbalanced)
                self.failed = self.failed or f"{type(exc).__name__}: {exc}"

    def finish(self) -> Facts:
        """Everything off; the layers' own functions back where ours still stand."""
        self.forward_done()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for layer, probed in self.funcs:
            if vars(layer).get(FUNC) is probed:
                if probed.own:
                    setattr(layer, FUNC, probed.func)
                else:
                    vars(layer).pop(FUNC, None)
        self.funcs.clear()
        return self.facts()

    # -- what autograd saves

    def saving(self, who: str, index: int) -> Any:
        """Saved-tensor hooks that note each save for (who, index) and hand it on to the hooks
        beneath (none: autograd's own keeping, detached so an output does not hold its node)."""
        torch = self.torch
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        below_pack, below_unpack = top if top is not None else (None, None)
        # our own hooks beneath (the step's, outside the layers) are passed over: a save is
        # noted once, for the innermost who
        below_pack, below_unpack = getattr(below_pack, "probe_below", (below_pack, below_unpack))

        def pack(tensor: Any) -> Any:
            self._saved(tensor, who, index)
            if below_pack is not None:
                return below_pack(tensor)
            return tensor.detach() if tensor.grad_fn is not None else tensor

        def unpack(packed: Any) -> Any:
            return below_unpack(packed) if below_unpack is not None else packed

        pack.probe_below = (below_pack, below_unpack)  # type: ignore[attr-defined]
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def entered(self, who: str, index: int) -> Any:
        """`saving(who, index)` entered, or None where saved-tensor hooks cannot be pushed here
        (disabled by the code around): the probe then fails, said once by the planner."""
        try:
            hooks = self.saving(who, index)
            hooks.__enter__()
        except Exception as exc:  # noqa: BLE001 (this call runs unprobed; the plan is skipped)
            self.failed = self.failed or f"{type(exc).__name__}: {exc}"
            return None
        return hooks

    def _saved(self, tensor: Any, who: str, index: int) -> None:
        torch = self.torch
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            return  # a weight (a view of one): not an activation
        entry = self.entry(tensor)
        if entry is None:
            return
        if who == OPERATORS and index != OUTSIDE and self.owner[-1] == (BLOCK, index):
            who = BLOCK
        entry.owners.add((who, index))
        if who in (OPERATORS, BLOCK) and index != OUTSIDE:
            # a non-reentrant recompute stops at the layer's last save (torch/utils/checkpoint.py
            # `_StopRecomputationError`): what ran before it is what a recompute runs
            facts = self.layer_facts[index]
            facts.until_saved = {**facts.flops}, {**facts.seconds}, {**facts.ops}

    def held_by_call(self, index: int, given: Any) -> None:
        """The tensors a checkpoint's call holds until its backward without saving them (the
        keyword arguments bound to the layer's call: an eager attention's mask)."""
        for tensor in tensors(self.torch, given):
            entry = self.entry(tensor)
            if entry is not None:
                entry.owners.add((CALL, index))

    def growth(self, tensor: Any) -> str:
        """How the tensor grows with the tokens: two of its dimensions the token count make it
        attention scores (square), or either where a weight of the layers has that size too."""
        tokens = self.shape[1]
        if tokens <= 1 or sum(1 for size in tensor.shape if size == tokens) < 2:
            return LINEAR
        return EITHER if tokens in self.sizes else SQUARE

    def entry(self, tensor: Any) -> _Entry | None:
        """The entry of the tensor's storage (a new one where that storage is new)."""
        key = _key(tensor)
        if key is None:
            return None
        found = self.live.get(key)
        if found is not None and not found[0].expired():
            return found[1]
        from torch.multiprocessing.reductions import StorageWeakRef

        storage = tensor.untyped_storage()
        entry = _Entry(int(storage.nbytes()), self.growth(tensor))
        self.entries.append(entry)
        self.live[key] = (StorageWeakRef(storage), entry)
        return entry

    # -- the feed-forward block

    def _enter_block(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            if not self.ours() or (self.recomputing and self.layer_facts[index].saved):
                return  # a recompute of what the forward already read
            self.owner.append((BLOCK, index))
            self.layer_facts[index].block_ran = True
            given = list(tensors(self.torch, args))
            self.versions.append([(t, _version(t)) for t in given])
            for tensor in given:
                entry = self.entry(tensor)
                if entry is not None:
                    entry.block_input.add(index)

        return hook

    def _leave_block(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self.ours() and self.owner[-1] == (BLOCK, index):
                self.owner.pop()
                if any(_version(t) != v for t, v in self.versions.pop()):
                    # Mixtral's router jitter multiplies its input in place: checkpointed alone,
                    # the block's saved input would have changed by its recompute
                    self.layer_facts[index].refused.setdefault(BLOCK, "its block writes its input")

        return hook

    # -- the operators of a layer's forward

    def operator(self, index: int, func: Any, args: tuple, kwargs: dict, out: Any, spent: float):
        facts = self.layer_facts[index]
        classes = [ALL]
        if func in self.matmuls:
            classes.append(MATMUL)
        if func in self.attention:
            classes.append(ATTENTION)
        if self.owner[-1] == (BLOCK, index):
            classes.append(BLOCK)
        flops = self._flops(func, args, kwargs, out)
        made = self.made.setdefault(index, {})
        self._writes(index, func, args, made)
        for name in classes:
            facts.ops[name] = facts.ops.get(name, 0) + 1
            facts.seconds[name] = facts.seconds.get(name, 0.0) + spent
            facts.flops[name] = facts.flops.get(name, 0.0) + flops
        for name in (MATMUL, ATTENTION):
            if name not in classes:
                continue
            from torch.multiprocessing.reductions import StorageWeakRef

            keys = made.setdefault(name, {})
            for tensor in tensors(self.torch, out):
                key = _key(tensor)
                if key is not None:
                    storage = tensor.untyped_storage()
                    keys[key] = StorageWeakRef(storage)
                    kept = facts.kept.get(name, Bytes())
                    facts.kept[name] = kept.plus(int(storage.nbytes()), self.growth(tensor))

    def _writes(self, index: int, func: Any, args: tuple, made: dict[str, dict]) -> None:
        """An operator writing into a matmul's or attention kernel's output (GPT-OSS's experts add
        their bias in place, transformers/integrations/moe.py): a selective checkpoint keeping it
        would be refused in the backward, so the lever keeping it is not offered here."""
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable or not args:
            return
        key = _key(args[0]) if isinstance(args[0], self.torch.Tensor) else None
        for name, keys in made.items():
            if key is not None and key in keys and not keys[key].expired():
                why = f"{func} writes into a kept output"
                self.layer_facts[index].refused.setdefault(name, why)

    def _flops(self, func: Any, args: tuple, kwargs: dict, out: Any) -> float:
        formula = self.flop_formulas.get(getattr(func, "_overloadpacket", None))
        if formula is None:
            return 0.0
        try:
            return float(formula(*args, **kwargs, out_val=out))
        except Exception as exc:  # noqa: BLE001 (a shape the formula cannot read: uncounted)
            log.debug("gcpatch: FLOPs of %s not counted (%s)", func, exc)
            return 0.0

    # -- the figures

    def ours(self) -> bool:
        """Whether this call belongs to the probed step: its thread, or the backward's recompute
        (which an accelerator's autograd runs on a thread of its own)."""
        return self.recomputing or threading.get_ident() == self.thread

    def facts(self) -> Facts:
        """Each layer's bytes from the saves: a storage saved for one layer alone is that layer's,
        one saved for several layers or outside them too (rotary tables, masks) is outside's: it
        is held whichever layers are checkpointed."""
        parts: dict[tuple[int, str], Bytes] = {}
        for entry in self.entries:
            for index, part in _parts(entry):
                parts[(index, part)] = parts.get((index, part), Bytes()).plus(
                    entry.nbytes, entry.growth
                )
        outside = parts.pop((OUTSIDE, "outside"), Bytes())
        calls = parts.pop((OUTSIDE, "calls"), Bytes())
        for index, facts in enumerate(self.layer_facts):
            for part in ("operators", "inputs", "block_only", "block_inputs"):
                setattr(facts, part, parts.get((index, part), Bytes()))
            if self.blocks[index] is not None and not facts.block_ran:
                facts.refused.setdefault(BLOCK, "its feed-forward block did not run")
        return Facts(self.layer_facts, outside, self.shape, self.accelerator, calls)


def _parts(entry: _Entry) -> list[tuple[int, str]]:
    """Where a saved storage counts: (layer, part) pairs, OUTSIDE's for one held whichever layers
    are checkpointed (saved outside the layers, or for several)."""
    layers = {index for _, index in entry.owners}
    whos = {who for who, _ in entry.owners}
    out = [
        (index, "block_inputs")  # what the block's own checkpoint keeps
        for index in entry.block_input
        if not (layers - {index}) and OPERATORS not in whos
    ]
    if not layers:
        return out
    if whos == {CALL}:  # held while some layer is checkpointed, by nothing plainly
        return [*out, (OUTSIDE, "calls")]
    if len(layers) != 1 or OUTSIDE in layers:
        return [*out, (OUTSIDE, "outside")]
    (index,) = layers
    if whos & {CHECKPOINT, CALL}:
        out.append((index, "inputs"))
    if whos & {OPERATORS, BLOCK}:
        out.append((index, "operators"))
    if whos & {OPERATORS, BLOCK} == {BLOCK}:
        out.append((index, "block_only"))
    return out


class _Entry:
    """One saved storage: its bytes, how it grows with the tokens (gcpatch/step/bytes.py), who
    saved it ((who, layer) pairs), and the layers whose feed-forward block took it as an input."""

    __slots__ = ("nbytes", "growth", "owners", "block_input")

    def __init__(self, nbytes: int, growth: str) -> None:
        self.nbytes, self.growth = nbytes, growth
        self.owners: set[tuple[str, int]] = set()
        self.block_input: set[int] = set()


class _Probed:
    """A layer's checkpoint function, probed: its checkpoint's saves, its forward's operators and
    saves, and its recompute's seconds (its saves too where the forward saved none)."""

    def __init__(self, func: Any, probe: Probe, index: int, own: bool = True) -> None:
        self.func, self.probe, self.index, self.own = func, probe, index, own

    def __deepcopy__(self, memo: dict) -> Any:
        """A copy of the model made mid-step (an EMA copy) gets the layer's own function."""
        import copy

        return copy.deepcopy(self.func, memo)

    def __reduce__(self) -> Any:
        return _itself, (self.func,)

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        probe = self.probe
        if threading.get_ident() != probe.thread or self.func is None:
            return self.func(function, *args, **kwargs)
        inner = _Inner(function, probe, self.index)
        probe.held_by_call(self.index, (getattr(function, "keywords", None), kwargs))
        hooks = probe.entered(CHECKPOINT, self.index)
        if hooks is None:
            return self.func(function, *args, **kwargs)
        try:
            return self.func(inner, *args, **kwargs)
        finally:
            hooks.__exit__(None, None, None)


class _Inner:
    """The function a probed checkpoint runs: the forward under the operators' probe, the
    recompute timed (and probed for its saves where the forward saved none: reentrant)."""

    def __init__(self, function: Callable[..., Any], probe: Probe, index: int) -> None:
        self.function, self.probe, self.index = function, probe, index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        probe, index = self.probe, self.index
        torch = probe.torch
        facts = probe.layer_facts[index]
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward:
            return self._recompute(facts, args, kwargs)
        hooks = probe.entered(OPERATORS, index)
        if hooks is None:
            return self.function(*args, **kwargs)
        probe.owner.append((OPERATORS, index))
        try:
            with _Operators(probe, index):
                out = self.function(*args, **kwargs)
            facts.saved = facts.saved or torch.is_grad_enabled()
            return out
        finally:
            probe.owner.pop()
            hooks.__exit__(None, None, None)

    def _recompute(self, facts: LayerFacts, args: tuple, kwargs: dict) -> Any:
        probe, index = self.probe, self.index
        start = time.perf_counter()
        probe.owner.append((OPERATORS, index))
        probe.recomputing = True
        try:
            if facts.saved:
                return self.function(*args, **kwargs)
            hooks = probe.entered(OPERATORS, index)
            if hooks is None:
                return self.function(*args, **kwargs)
            try:
                out = self.function(*args, **kwargs)
            finally:
                hooks.__exit__(None, None, None)
            facts.saved = True
            return out
        finally:
            probe.owner.pop()
            probe.recomputing = False
            facts.recompute += time.perf_counter() - start


class _Operators(TorchDispatchMode):
    """The dispatch mode of one layer's forward: each operator noted by the probe."""

    def __init__(self, probe: Probe, index: int) -> None:
        super().__init__()
        self.probe, self.index = probe, index
        self.clock = None if probe.accelerator else time.perf_counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        start = self.clock() if self.clock else 0.0
        out = func(*args, **kwargs)
        spent = self.clock() - start if self.clock else 0.0
        try:
            self.probe.operator(self.index, func, args, kwargs, out, spent)
        except Exception as exc:  # noqa: BLE001 (the step goes on; this operator uncounted)
            log.debug("gcpatch: operator %s not probed (%s)", func, exc)
        return out


def _itself(func: Any) -> Any:
    return func


def _flop_formulas() -> dict:
    """torch's FLOP formulas by operator packet (torch/utils/flop_counter.py `flop_registry`)."""
    try:
        from torch.utils.flop_counter import flop_registry
    except Exception as exc:  # noqa: BLE001 (no formulas: the levers are priced by the clock alone)
        log.debug("gcpatch: torch's FLOP formulas unavailable (%s)", exc)
        return {}
    formulas = dict(flop_registry)
    aten = sys.modules["torch"].ops.aten
    # the CPU flash kernel takes (query, key, value, ...) as the others do, and has no formula
    fused = formulas.get(getattr(aten, "_scaled_dot_product_flash_attention", None))
    cpu = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fused is not None and cpu is not None:
        formulas.setdefault(cpu, fused)
    grouped = getattr(aten, "_grouped_mm", None)  # MoE experts' (no formula in torch 2.13)
    if grouped is not None:
        formulas.setdefault(grouped, _grouped_mm_flops)
    return formulas


def _grouped_mm_flops(a: Any, b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> float:
    """A grouped matmul's FLOPs: 2 x its output's elements x the inner dimension."""
    return 2.0 * out_val.numel() * a.shape[-1]


def _version(tensor: Any) -> int | None:
    """Its version counter (bumped by every in-place write), or None where it keeps none."""
    try:
        return int(tensor._version)
    except Exception:  # noqa: BLE001 (an inference tensor: no counter, no write seen)
        return None


def _key(tensor: Any) -> int | None:
    try:
        return int(tensor.untyped_storage()._cdata)
    except Exception:  # noqa: BLE001 (a tensor subclass without a storage: not counted)
        return None
