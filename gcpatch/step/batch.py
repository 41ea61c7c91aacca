"""The batch of a training forward: its size, its shape, and its first rows as new leaves (what
gcpatch's own passes at the first step run on, so they never need the memory of the whole batch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator

# The inputs that name the batch's rows, in the order they are looked for.
_INPUTS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features")
# Per-call tensors whose first dimension is not the batch even when its length happens to match.
NOT_BATCHED = frozenset({"cache_position"})


def tensors(torch: Any, value: Any) -> Iterator[Any]:
    """Every tensor in `value`, through mappings, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors(torch, item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(torch, item)


def main_input(torch: Any, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """The tensor that names the batch: a model input by its usual name, else the first tensor
    argument with a dimension."""
    for name in _INPUTS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value
    return None


def batch_size(torch: Any, args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    value = main_input(torch, args, kwargs)
    return None if value is None else int(value.shape[0])


def shape(torch: Any, args: tuple, kwargs: Mapping[str, Any]) -> tuple[int, int] | None:
    """(rows, tokens) of the batch: its main input's first two dimensions (tokens 1 for an input
    with one dimension)."""
    value = main_input(torch, args, kwargs)
    if value is None:
        return None
    return int(value.shape[0]), int(value.shape[1]) if value.dim() >= 2 else 1


def first_rows(torch: Any, value: Any, batch: int, rows: int, name: str = "") -> Any:
    """The first `rows` rows of every tensor whose first dimension is the batch, as new leaves
    (the user's graph upstream of the model is never reached), keeping requires_grad."""
    if isinstance(value, torch.Tensor):
        if name in NOT_BATCHED or value.dim() == 0 or value.shape[0] != batch:
            return value
        part = value[:rows].detach().clone()
        return (
            part.requires_grad_(True) if value.requires_grad and part.is_floating_point() else part
        )
    if isinstance(value, dict):
        return {k: first_rows(torch, v, batch, rows, k) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(first_rows(torch, v, batch, rows, name) for v in value)
    if isinstance(value, list):
        return [first_rows(torch, v, batch, rows, name) for v in value]
    return value
