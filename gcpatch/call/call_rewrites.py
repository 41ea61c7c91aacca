"""How a checkpoint call is rewritten so that reentrant checkpointing, kept as the caller chose it,
gives exact gradients: what reentrant does not see is handed to it where it does look.

- CK5 and CK1 (`lift`): a partial's bound tensors that have a graph become positional inputs.
- CK1 (`with_grad_input`): a call none of whose inputs requires grad gets one more positional
  input that does (an empty tensor the function never sees), so the parameters inside get their
  gradients, as R2's input-grads hook does for a model's layers.
- CK7 (`as_tuple`): a result holding tensors inside a dict, list or ModelOutput passes through the
  checkpoint as a flat tuple (the only shape reentrant tracks) and is rebuilt after it.

`rng_snapshot` lets a call whose first result showed what reentrant could not track run again,
from the RNG state it started from, as decided.
"""

from __future__ import annotations

import functools
from types import CellType, FunctionType
from typing import Any, Callable


def lift(function: Any, args: tuple, tensor: type) -> tuple[Any, tuple]:
    """CK5: the grad-requiring tensors with a graph bound into the function (a partial's arguments
    and keywords, or a function's closure cells and default arguments) become positional inputs of
    the checkpoint, so reentrant backward returns their gradients through the caller's graph
    instead of running that graph inside its own backward. Returns the function and the
    checkpoint's positional arguments after it."""
    if isinstance(function, FunctionType):
        return _lift_function(function, args, tensor)
    params = list(function.args)
    keywords = dict(function.keywords)
    slots = [i for i, a in enumerate(params) if _graph_tensor(a, tensor)]
    names = [k for k, v in keywords.items() if _graph_tensor(v, tensor)]
    moved = tuple(params[i] for i in slots) + tuple(keywords[k] for k in names)
    count = len(args) - 1
    inner = function.func

    def lifted(*inputs: Any) -> Any:
        given, values = inputs[:count], inputs[count:]
        call_params, call_keywords = list(params), dict(keywords)
        for i, value in zip(slots, values):
            call_params[i] = value
        for name, value in zip(names, values[len(slots) :]):
            call_keywords[name] = value
        return inner(*call_params, *given, **call_keywords)

    return lifted, (*args[1:], *moved)


def _lift_function(function: FunctionType, args: tuple, tensor: type) -> tuple[Any, tuple]:
    """`lift` for a plain function: each call runs a copy of it whose graph-tensor closure cells
    and defaults hold the checkpoint's inputs instead (the code, globals and other cells are the
    function's own)."""
    cells = list(function.__closure__ or ())
    defaults = list(function.__defaults__ or ())
    kwdefaults = dict(function.__kwdefaults__ or {})
    cell_slots = [i for i, c in enumerate(cells) if _graph_tensor(_contents(c), tensor)]
    default_slots = [i for i, d in enumerate(defaults) if _graph_tensor(d, tensor)]
    names = [k for k, v in kwdefaults.items() if _graph_tensor(v, tensor)]
    moved = (
        tuple(cells[i].cell_contents for i in cell_slots)
        + tuple(defaults[i] for i in default_slots)
        + tuple(kwdefaults[k] for k in names)
    )
    count = len(args) - 1

    def lifted(*inputs: Any) -> Any:
        given, values = inputs[:count], list(inputs[count:])
        new_cells, new_defaults, new_kw = list(cells), list(defaults), dict(kwdefaults)
        for i in cell_slots:
            new_cells[i] = CellType(values.pop(0))
        for i in default_slots:
            new_defaults[i] = values.pop(0)
        for name in names:
            new_kw[name] = values.pop(0)
        copy = FunctionType(
            function.__code__,
            function.__globals__,
            function.__name__,
            tuple(new_defaults) or None,
            tuple(new_cells) or None,
        )
        copy.__kwdefaults__ = new_kw or None
        return copy(*given)

    return lifted, (*args[1:], *moved)


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _graph_tensor(value: Any, tensor: type) -> bool:
    return isinstance(value, tensor) and value.requires_grad and value.grad_fn is not None


def with_grad_input(function: Any, rest: tuple, torch: Any) -> tuple[Any, tuple]:
    """CK1, reentrant kept: an empty leaf that requires grad goes first among the inputs, so the
    checkpoint's output requires grad and its backward reaches the parameters inside; the function
    is called without it. Its own gradient is None (nothing uses it)."""

    def takes_grad_input(_grad_input: Any, *inputs: Any) -> Any:
        return function(*inputs)

    return takes_grad_input, (torch.empty(0, requires_grad=True), *rest)


def as_tuple(function: Any, pytree: Any) -> tuple[Any, Callable[[Any], Any]]:
    """CK7: the function as one returning its result's leaves as a tuple (recorded on each run:
    the forward and the recompute build the same structure), and how to rebuild the result from
    the checkpoint's tuple."""
    spec: list[Any] = []

    def flat(*args: Any, **kwargs: Any) -> tuple:
        leaves, tree = pytree.tree_flatten(function(*args, **kwargs))
        spec[:] = [tree]
        return tuple(leaves)

    def rebuild(result: Any) -> Any:
        return pytree.tree_unflatten(list(result), spec[0])

    return flat, rebuild


def codes() -> list[Any]:
    """The code objects of the functions these rewrites put between torch's checkpoint and the
    user's function (marked for torch.compile to run eagerly, as the decision's own frames are)."""
    found = [
        lift(functools.partial(len), (len,), type(None))[0].__code__,
        _lift_function(lambda: None, (len,), type(None))[0].__code__,
        with_grad_input(len, (), _NoTorch)[0].__code__,
        as_tuple(len, None)[0].__code__,
    ]
    return found


class _NoTorch:
    """Stands in for torch where `codes` builds a rewrite only to read its code object."""

    @staticmethod
    def empty(*args: Any, **kwargs: Any) -> None:
        return None


def rng_snapshot(torch: Any, args: tuple) -> Callable[[], None]:
    """The RNG states a checkpoint call starts from (CPU, and the devices of its tensor inputs, as
    torch's checkpoint preserves them), and a function that puts them back."""
    cpu = torch.get_rng_state()
    utils = torch.utils.checkpoint
    devices, states = utils.get_device_states(*args)
    kind = next(
        (
            a.device.type
            for a in args
            if isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta")
        ),
        None,
    )

    def restore() -> None:
        torch.set_rng_state(cpu)
        if devices:
            utils.set_device_states(devices, states, device_type=kind)

    return restore
