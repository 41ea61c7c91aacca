"""What one `torch.utils.checkpoint.checkpoint` call shows about itself: read from its own
arguments (and, once per function, from its first result), never inferred.

Reentrant checkpointing sees only a call's top-level positional tensors on the way in and only a
tensor or a tuple's tensors on the way out. Everything else a function runs with (a module's
parameters, a partial's arguments and keywords, closure cells, default arguments, tensors inside a
list, dict or dataclass argument) and everything it returns inside another container is invisible
to it: the facts here say what is there, so the call's rules (plugins/torch_checkpoint.py) can tell
a correct reentrant call from one that loses gradients or crashes. Pure reads, bounded: a
pathological closure or container costs a few reads, never a walk of the program.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import FunctionType, MethodType
from typing import Any

# How far the container walks go: a batch of tensors in a list is a few items, not a program.
_ITEMS = 16
_DEPTH = 3
# What the call's result shows reentrant checkpointing could not track (CK7): nothing, tensors
# inside containers that can be passed through it as a flat tuple and rebuilt ("rebuildable"), or
# tensors inside objects that cannot ("opaque": a dataclass or other object holding tensors).
TRACKED, REBUILDABLE, OPAQUE = "", "rebuildable", "opaque"


class Reach:
    """What a checkpointed function holds besides its positional inputs."""

    __slots__ = ("modules", "bound_grad", "graph_tensors", "liftable")

    def __init__(
        self,
        modules: tuple[Any, ...] = (),
        # a tensor that requires grad is bound (partial, closure, default argument)
        bound_grad: bool = False,
        graph_tensors: int = 0,  # ... of which this many have a graph of their own (not leaves)
        # every such tensor is an argument of the partial itself, or a closure cell or default
        # argument of the function itself (CK5 can pass it positionally)
        liftable: bool = False,
    ) -> None:
        self.modules, self.bound_grad = modules, bound_grad
        self.graph_tensors, self.liftable = graph_tensors, liftable


NOTHING = Reach()


def reach(function: Any, tensor: type, module_type: type) -> Reach:
    """The modules and grad-requiring tensors a checkpointed function runs with besides its
    positional inputs: the function itself, a bound method's owner, a partial's arguments and
    keywords (transformers: `partial(forward, layer, **kwargs)`), closure cells (FSDP's reentrant
    wrapper, hand-written `custom_forward`s) and default arguments."""
    modules: list[Any] = []
    bound_grad = False
    graph = lifted = 0
    pending: list[tuple[Any, bool]] = [(function, False)]  # (item, an argument of the top partial)
    for _ in range(24):
        if not pending:
            break
        item, top = pending.pop()
        if isinstance(item, tensor):
            if item.requires_grad:
                bound_grad = True
                if item.grad_fn is not None:
                    graph += 1
                    lifted += top
        elif isinstance(item, module_type):
            modules.append(item)
        elif isinstance(item, functools.partial):
            first = item is function
            pending.append((item.func, False))
            pending.extend((a, first) for a in item.args)
            pending.extend((v, first) for v in item.keywords.values())
        elif isinstance(item, (tuple, list)):
            pending.extend((v, False) for v in item[:8])
        elif callable(item):
            pending.extend(_bound_by(item, function))
    if not (modules or bound_grad):
        return NOTHING
    return Reach(tuple(modules), bound_grad, graph, bool(graph) and lifted == graph)


def _bound_by(item: Any, function: Any) -> list[tuple[Any, bool]]:
    """What a callable runs with besides its arguments, as `reach`'s (item, liftable) pairs: a
    bound method's owner, closure cells, default arguments. Liftable where `item` is the
    checkpointed function itself (not a method): it can be rebuilt with other cells and defaults."""
    owner = getattr(item, "__self__", None)
    first = item is function and owner is None and isinstance(item, FunctionType)
    code = getattr(item, "__func__", item)
    kwdefaults = getattr(code, "__kwdefaults__", None) or {}
    bound = [*_cells(code), *(getattr(code, "__defaults__", None) or ()), *kwdefaults.values()]
    return ([(owner, False)] if owner is not None else []) + [(value, first) for value in bound]


def _cells(code: Any) -> list[Any]:
    """The values a function's closure cells hold (an empty cell: nothing bound there yet)."""
    values = []
    for cell in getattr(code, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:
            continue
    return values


def binds_graph_tensors(function: Any, tensor: type, module_type: type) -> bool:
    """The hot path's question for a correct reentrant call (CK5): does a tensor with a graph reach
    the function other than positionally? Read one level deep, building nothing: a partial's
    arguments and keywords (and tuples among them: transformers' `position_embeddings`), or a
    function's closure cells and default arguments (a per-call closure, `def run(h=h)`). `reach`
    looks deeper once a call is off the hot path."""
    if type(function) is functools.partial:
        return _has_graph(function.keywords.values(), tensor) or _has_graph(function.args, tensor)
    if isinstance(function, module_type):  # no attribute read: nn.Module.__getattr__ is slow
        return False
    code = getattr(function, "__func__", function)
    defaults = getattr(code, "__defaults__", None) or ()
    return _has_graph(_cells(code), tensor) or _has_graph(defaults, tensor)


def _has_graph(values: Any, tensor: type) -> bool:
    for value in values:
        if isinstance(value, tensor):
            if value.grad_fn is not None:
                return True
        elif type(value) is tuple:
            for item in value:
                if isinstance(item, tensor) and item.grad_fn is not None:
                    return True
    return False


def containers_hold_graph(args: tuple, tensor: type) -> bool:
    """The hot path's question about the call's positional arguments (CK5): is a tensor with a
    graph inside a list, tuple, dict or dataclass among them? Reentrant checkpointing passes such
    an argument to the recompute as it is, graph and all. One level of a plain container is read
    here; `in_containers` looks deeper off the hot path."""
    for value in args:
        kind = type(value)
        if kind is list or kind is tuple:
            if _has_graph(value, tensor):
                return True
        elif kind is dict:
            if _has_graph(value.values(), tensor):
                return True
        elif not isinstance(value, tensor) and (
            isinstance(value, Mapping) or dataclasses.is_dataclass(value)
        ):
            return in_containers(args, tensor)[1] > 0
    return False


def in_containers(args: tuple, tensor: type) -> tuple[bool, int]:
    """(a grad-requiring tensor sits inside a container argument, how many of those have a graph
    of their own): tensors inside lists, tuples, dicts, mappings (ModelOutput) and dataclasses
    among the positional arguments, which reentrant checkpointing does not see."""
    grad, graph = False, 0
    pending = [(value, 0) for value in args if not isinstance(value, tensor)]
    seen = 0
    while pending and seen < _ITEMS * _DEPTH:
        value, depth = pending.pop()
        seen += 1
        if isinstance(value, tensor):
            if depth and value.requires_grad:
                grad = True
                graph += value.grad_fn is not None
            continue
        if depth >= _DEPTH:
            continue
        for item in _items(value):
            pending.append((item, depth + 1))
    return grad, graph


def _items(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value[:_ITEMS])
    if isinstance(value, Mapping):
        return list(value.values())[:_ITEMS]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name, None) for f in dataclasses.fields(value)][:_ITEMS]
    return []


def tracked_quickly(result: Any, tensor: type) -> bool:
    """The hot path's look at a reentrant call's result: a tensor, or a tuple of tensors and plain
    values, is all reentrant tracks and all it needs to; anything else is looked at closely."""
    if isinstance(result, tensor):
        return True
    if type(result) is tuple:
        for item in result:
            if not (item is None or isinstance(item, (tensor, int, float, bool, str))):
                return False
        return True
    return False


def untracked_outputs(result: Any, tensor: type, pytree: Any) -> str:
    """What reentrant checkpointing could not track in a call's result: TRACKED where every tensor
    is the result itself or an item of the tuple it is (what `autograd.Function` tracks), else
    REBUILDABLE where torch's pytree flattens the result into tensors and plain values (dicts,
    lists, transformers' ModelOutput, which registers itself), else OPAQUE."""
    if isinstance(result, tensor):
        return TRACKED
    top = result if type(result) is tuple else (result,)
    if not any(not isinstance(item, tensor) and _holds_tensor(item, tensor, 0) for item in top):
        return TRACKED
    leaves, _ = pytree.tree_flatten(result)
    if any(not isinstance(leaf, tensor) and _holds_tensor(leaf, tensor, 0) for leaf in leaves):
        return OPAQUE
    return REBUILDABLE


def _holds_tensor(value: Any, tensor: type, depth: int) -> bool:
    if isinstance(value, tensor):
        return value.is_floating_point() or value.is_complex()
    if depth >= _DEPTH:
        return False
    if isinstance(value, (list, tuple, Mapping)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    ):
        return any(_holds_tensor(item, tensor, depth + 1) for item in _items(value))
    return False


# The classes known to define none of `__self__`, `__func__`, `__code__`: their instances are keyed
# by their class without asking each (nn.Module's __getattr__ made that cost ~3 us a call). Bounded:
# classes made per call must not pile up.
_PLAIN_KINDS: set[type] = set()


def code_key(function: Any) -> Any:
    """Which function a call checkpoints, the same across calls and steps: the code of the function
    under any partials, with a bound method's class (transformers binds `layer.__call__`, whose
    code every module shares), or a module's class. What a call's result looked like is kept by
    this key."""
    for _ in range(4):
        if type(function) is not functools.partial:
            break
        function = function.func
    kind = type(function)
    if kind is FunctionType:
        return function.__code__
    if kind is MethodType and type(function.__func__) is FunctionType:
        return (function.__func__.__code__, type(function.__self__))
    if kind in _PLAIN_KINDS and not _function_like(getattr(function, "__dict__", None)):
        return kind  # a module or another callable object, asked nothing
    owner = getattr(function, "__self__", None)
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    if code is None:
        if len(_PLAIN_KINDS) < 1024 and not any(_function_like(vars(c)) for c in kind.__mro__):
            _PLAIN_KINDS.add(kind)
        return kind
    return (code, type(owner)) if owner is not None else code


def _function_like(names: Any) -> bool:
    return names is not None and ("__self__" in names or "__func__" in names or "__code__" in names)


def any_trainable(modules: tuple[Any, ...]) -> bool:
    return any(_trainable(m) for m in modules)


def _trainable(module: Any) -> bool:
    """Whether any parameter of `module` or its children requires grad: the registries read
    directly, as `parameters()`' generator costs several times more on the hot path."""
    for param in module._parameters.values():
        if param is not None and param.requires_grad:
            return True
    return any(child is not None and _trainable(child) for child in module._modules.values())
